module github.com/hexgen-flow/hexgen-flow/clients/go

// Built and tested offline in GOPATH mode against Debian bookworm's packages (test.sh,
// README.md): golang-google-grpc-dev 1.33.3, golang-google-protobuf-dev 1.28.1,
// golang-opentelemetry-otel-dev 1.1.0 (the API in package hexgenflow; the SDK and the
// stdouttrace exporter in example/traced), Go 1.19.
// With a module proxy, `go mod tidy` writes go.sum for these versions (or later ones).
go 1.19

require (
	go.opentelemetry.io/otel v1.1.0
	go.opentelemetry.io/otel/exporters/stdout/stdouttrace v1.1.0
	go.opentelemetry.io/otel/sdk v1.1.0
	go.opentelemetry.io/otel/trace v1.1.0
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
