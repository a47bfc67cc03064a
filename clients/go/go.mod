module github.com/hexgen-flow/hexgen-flow/clients/go

// Built and tested offline in GOPATH mode against Debian bookworm's packages (test.sh,
// README.md): golang-google-grpc-dev 1.33.3, golang-google-protobuf-dev 1.28.1, Go 1.19.
// With a module proxy, `go mod tidy` writes go.sum for these versions (or later ones).
go 1.19

require (
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
