package hexgenflow

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
)

// APIKeyHeader is the metadata key the API key travels in, as "Bearer <key>": a secured
// coordinator (`hexgen-flow up --secure`) authenticates every call by it, and answers
// UNAUTHENTICATED without one. A coordinator that is not secured ignores it.
const APIKeyHeader = "authorization"

// APIKeyEnv is the environment variable the API key comes from when neither WithAPIKey
// nor WithAPIKeyFile is given (as for the Python client and the CLI).
const APIKeyEnv = "HEXGEN_FLOW_API_KEY"

// TLSCAEnv is the environment variable naming the CA file (PEM) to verify the
// coordinator's certificate with when no WithTLSCA, WithTLS or WithTransportCredentials is
// given: set, the connection is TLS; unset or empty, plaintext.
const TLSCAEnv = "HEXGEN_FLOW_TLS_CA"

// TraceparentHeader is the W3C trace context header, as gRPC metadata. Every call sends
// it when its context carries one: a value given with WithTraceparent, or else a valid
// OpenTelemetry span (trace.SpanContextFromContext), injected with the W3C propagator
// (propagation.TraceContext, which adds tracestate when the span has one).
const TraceparentHeader = "traceparent"

// TracestateHeader is the W3C tracestate header, sent with an OpenTelemetry span's
// traceparent when its trace state is not empty.
const TracestateHeader = "tracestate"

// DefaultMaxRecvBytes is the largest response the client accepts by default (a GetQuery
// of a long query carries its whole event log; gRPC's own default is 4 MiB).
const DefaultMaxRecvBytes = 64 << 20

// Option configures Dial.
type Option func(*options)

type options struct {
	creds      credentials.TransportCredentials
	tlsCA      *string // WithTLSCA; nil: $HEXGEN_FLOW_TLS_CA
	apiKey     *string // WithAPIKey; nil: $HEXGEN_FLOW_API_KEY (unless apiKeyFile)
	apiKeyFile string  // WithAPIKeyFile
	key        string  // the key sent, once resolved
	headers    metadata.MD
	block      bool
	maxRecv    int
	dialOpts   []grpc.DialOption
}

// WithTLS connects over TLS with cfg (nil: the system roots and the address's host name).
// Without it (or WithTLSCA, WithTransportCredentials, $HEXGEN_FLOW_TLS_CA) the connection
// is plaintext, as `hexgen-flow up` without --secure serves.
func WithTLS(cfg *tls.Config) Option {
	return func(o *options) {
		if cfg == nil {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		o.creds = credentials.NewTLS(cfg)
	}
}

// WithTLSCA connects over TLS, verifying the coordinator's certificate against the CA
// in caFile (PEM; what `hexgen-flow up --secure` writes as AUTH_DIR/ca.pem) and the
// address's host name (credentials.NewClientTLSFromFile). It overrides
// $HEXGEN_FLOW_TLS_CA; WithTLSCA("") means plaintext whatever the environment says.
// WithTLS and WithTransportCredentials win over it.
func WithTLSCA(caFile string) Option {
	return func(o *options) { o.tlsCA = &caFile }
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

// WithAPIKey sends key with every call, as the metadata "authorization: Bearer <key>"
// (over plaintext too: TLS may end at a proxy in front of the coordinator). It overrides
// $HEXGEN_FLOW_API_KEY; WithAPIKey("") sends no key whatever the environment says. A
// call's own key (WithCallAPIKey) wins over it.
func WithAPIKey(key string) Option {
	return func(o *options) { o.apiKey, o.apiKeyFile = &key, "" }
}

// WithAPIKeyFile reads the API key from a file (its first line, surrounding white space
// removed; AUTH_DIR/tenants/NAME.key of `hexgen-flow up --secure`) when dialing, and sends
// it as WithAPIKey does. Dial fails if the file cannot be read or holds no key.
func WithAPIKeyFile(path string) Option {
	return func(o *options) { o.apiKeyFile, o.apiKey = path, nil }
}

// WithCallAPIKey returns a context whose calls send key instead of the client's (a server
// acting for several callers, each with its own key).
func WithCallAPIKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, APIKeyHeader, bearer(key))
}

func bearer(key string) string { return "Bearer " + key }

// resolve settles what the options leave to files and the environment: the API key and,
// when no transport credentials were given, TLS from a CA file.
func (o *options) resolve() error {
	switch {
	case o.apiKeyFile != "":
		data, err := os.ReadFile(o.apiKeyFile)
		if err != nil {
			return fmt.Errorf("hexgenflow: API key file: %w", err)
		}
		o.key = strings.TrimSpace(strings.SplitN(strings.TrimSpace(string(data)), "\n", 2)[0])
		if o.key == "" {
			return fmt.Errorf("hexgenflow: API key file %s holds no key", o.apiKeyFile)
		}
	case o.apiKey != nil:
		o.key = *o.apiKey
	default:
		o.key = strings.TrimSpace(os.Getenv(APIKeyEnv))
	}
	if o.creds != nil {
		return nil
	}
	ca := os.Getenv(TLSCAEnv)
	if o.tlsCA != nil {
		ca = *o.tlsCA
	}
	if ca == "" {
		return nil
	}
	creds, err := credentials.NewClientTLSFromFile(ca, "")
	if err != nil {
		return fmt.Errorf("hexgenflow: TLS CA %s: %w", ca, err)
	}
	o.creds = creds
	return nil
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
// metadata, so the coordinator's spans join the caller's trace: for callers without
// OpenTelemetry (with it, a context carrying a span is enough; see TraceparentHeader). It
// wins over the context's span; an empty value sends nothing.
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

// outgoing adds the client's API key, headers and the context's traceparent to ctx's
// outgoing metadata, leaving alone any key the context already sets.
func (o *options) outgoing(ctx context.Context) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	var add []string
	if o.key != "" && len(md.Get(APIKeyHeader)) == 0 && len(o.headers.Get(APIKeyHeader)) == 0 {
		add = append(add, APIKeyHeader, bearer(o.key))
	}
	for key, values := range o.headers {
		if len(md.Get(key)) > 0 {
			continue
		}
		for _, v := range values {
			add = append(add, key, v)
		}
	}
	if len(md.Get(TraceparentHeader)) == 0 {
		if tp := TraceparentFrom(ctx); tp != "" {
			add = append(add, TraceparentHeader, tp)
		} else if trace.SpanContextFromContext(ctx).IsValid() {
			carrier := mdCarrier{}
			propagation.TraceContext{}.Inject(ctx, carrier)
			for key, values := range carrier {
				if key == TraceparentHeader || len(md.Get(key)) == 0 {
					for _, v := range values {
						add = append(add, key, v)
					}
				}
			}
		}
	}
	if len(add) == 0 {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, add...)
}

// mdCarrier is gRPC metadata as an OpenTelemetry TextMapCarrier (keys lower-case).
type mdCarrier metadata.MD

func (c mdCarrier) Get(key string) string {
	if values := metadata.MD(c).Get(key); len(values) > 0 {
		return values[0]
	}
	return ""
}

func (c mdCarrier) Set(key, value string) { metadata.MD(c).Set(key, value) }

func (c mdCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for key := range c {
		keys = append(keys, key)
	}
	return keys
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
