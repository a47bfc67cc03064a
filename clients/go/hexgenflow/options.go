package hexgenflow

import (
	"context"
	"crypto/tls"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
)

// APIKeyHeader is the metadata key WithAPIKey sends. The coordinator does not check keys
// yet; a gateway or proxy in front of it may.
const APIKeyHeader = "x-api-key"

// TraceparentHeader is the W3C trace context header, as gRPC metadata.
const TraceparentHeader = "traceparent"

// DefaultMaxRecvBytes is the largest response the client accepts by default (a GetQuery
// of a long query carries its whole event log; gRPC's own default is 4 MiB).
const DefaultMaxRecvBytes = 64 << 20

// Option configures Dial.
type Option func(*options)

type options struct {
	creds    credentials.TransportCredentials
	headers  metadata.MD
	block    bool
	maxRecv  int
	dialOpts []grpc.DialOption
}

// WithTLS connects over TLS with cfg (nil: the system roots and the address's host name).
// Without it the connection is plaintext, as `hexgen-flow up` serves.
func WithTLS(cfg *tls.Config) Option {
	return func(o *options) {
		if cfg == nil {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		o.creds = credentials.NewTLS(cfg)
	}
}

// WithTransportCredentials connects with any gRPC transport credentials (mTLS, ALTS, ...).
func WithTransportCredentials(creds credentials.TransportCredentials) Option {
	return func(o *options) { o.creds = creds }
}

// WithHeader sends the metadata key: value with every call (keys are lower-cased, as
// gRPC requires). Metadata the call's context already carries under that key wins.
func WithHeader(key, value string) Option {
	return func(o *options) {
		if o.headers == nil {
			o.headers = metadata.MD{}
		}
		o.headers.Append(strings.ToLower(key), value)
	}
}

// WithAPIKey sends key in the APIKeyHeader metadata of every call.
func WithAPIKey(key string) Option {
	return WithHeader(APIKeyHeader, key)
}

// WithBlock makes Dial wait until the connection is up (bounded by Dial's context); a
// coordinator that does not answer is then an UNAVAILABLE error from Dial itself rather
// than from the first call.
func WithBlock() Option {
	return func(o *options) { o.block = true }
}

// WithMaxRecvBytes sets the largest response accepted (default DefaultMaxRecvBytes).
func WithMaxRecvBytes(n int) Option {
	return func(o *options) { o.maxRecv = n }
}

// WithDialOptions passes options to grpc.DialContext as they are (keepalive, a custom
// dialer, interceptors of your own, ...).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOpts = append(o.dialOpts, opts...) }
}

type traceparentKey struct{}

// WithTraceparent returns a context whose calls carry the W3C trace context value
// ("00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>") as the traceparent
// metadata, so the coordinator's spans join the caller's trace. An OpenTelemetry SDK's
// propagator can fill it from the active span; an empty value sends nothing.
func WithTraceparent(ctx context.Context, traceparent string) context.Context {
	return context.WithValue(ctx, traceparentKey{}, traceparent)
}

// TraceparentFrom is the value WithTraceparent put in ctx ("" when none).
func TraceparentFrom(ctx context.Context) string {
	v, _ := ctx.Value(traceparentKey{}).(string)
	return v
}

// WithMetadata returns a context whose calls carry the given metadata pairs (key, value,
// key, value, ...) besides the client's headers: per-call metadata such as another
// API key. It is metadata.AppendToOutgoingContext.
func WithMetadata(ctx context.Context, kv ...string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, kv...)
}

// outgoing adds the client's headers and the context's traceparent to ctx's outgoing
// metadata, leaving alone any key the context already sets.
func (o *options) outgoing(ctx context.Context) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	var add []string
	for key, values := range o.headers {
		if len(md.Get(key)) > 0 {
			continue
		}
		for _, v := range values {
			add = append(add, key, v)
		}
	}
	if tp := TraceparentFrom(ctx); tp != "" && len(md.Get(TraceparentHeader)) == 0 {
		add = append(add, TraceparentHeader, tp)
	}
	if len(add) == 0 {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, add...)
}

func (o *options) unaryInterceptor(
	ctx context.Context, method string, req, reply interface{},
	cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption,
) error {
	return invoker(o.outgoing(ctx), method, req, reply, cc, opts...)
}

func (o *options) streamInterceptor(
	ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string,
	streamer grpc.Streamer, opts ...grpc.CallOption,
) (grpc.ClientStream, error) {
	return streamer(o.outgoing(ctx), desc, cc, method, opts...)
}
