package hexgenflow

// Unit tests that need no server: the metadata a call sends (headers, per-call metadata,
// the traceparent of WithTraceparent or of an OpenTelemetry span), parsing the
// retry-after trailer, error texts. What the coordinator does with them is tested live
// (client_test.go, and tests/test_client_traces.py for the traceparent).

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
)

// sent is the outgoing metadata a call made with ctx through a client with opts carries.
func sent(ctx context.Context, opts ...Option) metadata.MD {
	o := &options{}
	for _, opt := range opts {
		opt(o)
	}
	if err := o.resolve(); err != nil {
		panic(err)
	}
	md, _ := metadata.FromOutgoingContext(o.outgoing(ctx))
	return md
}

func one(t *testing.T, md metadata.MD, key, want string) {
	t.Helper()
	if got := md.Get(key); len(got) != 1 || got[0] != want {
		t.Errorf("%s: %v, want [%s]", key, got, want)
	}
}

func TestOutgoingHeaders(t *testing.T) {
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	opts := []Option{WithAPIKey("k-123"), WithHeader("X-Tenant-Hint", "a")}
	md := sent(WithTraceparent(context.Background(), tp), opts...)
	one(t, md, "authorization", "Bearer k-123")
	one(t, md, "x-tenant-hint", "a")
	one(t, md, TraceparentHeader, tp)

	// Per-call metadata wins over the client's header of the same key; a call's own API
	// key over the client's.
	md = sent(WithMetadata(context.Background(), "x-tenant-hint", "per-call"), opts...)
	one(t, md, "x-tenant-hint", "per-call")
	one(t, md, "authorization", "Bearer k-123")
	md = sent(WithCallAPIKey(context.Background(), "other"), opts...)
	one(t, md, "authorization", "Bearer other")

	// Without a traceparent or a span nothing is sent.
	if got := sent(context.Background(), opts...).Get(TraceparentHeader); len(got) != 0 {
		t.Errorf("traceparent sent without one: %v", got)
	}
}

func TestOutgoingTraceparentOfASpan(t *testing.T) {
	traceID, _ := trace.TraceIDFromHex("0af7651916cd43dd8448eb211c80319c")
	spanID, _ := trace.SpanIDFromHex("b7ad6b7169203331")
	state, err := trace.ParseTraceState("vendor=v1")
	if err != nil {
		t.Fatal(err)
	}
	span := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled, TraceState: state,
	})
	ctx := trace.ContextWithSpanContext(context.Background(), span)
	md := sent(ctx)
	one(t, md, TraceparentHeader, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	one(t, md, TracestateHeader, "vendor=v1")

	// An unsampled span still propagates (flags 00): the callee decides what it records.
	unsampled := trace.ContextWithSpanContext(context.Background(), span.WithTraceFlags(0))
	one(t, sent(unsampled), TraceparentHeader, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00")

	// WithTraceparent wins over the span; so does a traceparent already in the metadata.
	const explicit = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	one(t, sent(WithTraceparent(ctx, explicit)), TraceparentHeader, explicit)
	one(t, sent(WithMetadata(ctx, TraceparentHeader, explicit)), TraceparentHeader, explicit)

	// An invalid span context (none) sends nothing.
	invalid := trace.ContextWithSpanContext(context.Background(), trace.SpanContext{})
	if got := sent(invalid).Get(TraceparentHeader); len(got) != 0 {
		t.Errorf("traceparent of an invalid span: %v", got)
	}
}

func TestParseRetryAfter(t *testing.T) {
	cases := map[string]time.Duration{
		"2.5": 2500 * time.Millisecond, " 121.506 ": 121506 * time.Millisecond, "0": 0,
		"-1": 0, "NaN": 0, "soon": 0, "1e9": 0,
	}
	for value, want := range cases {
		if got := parseRetryAfter(metadata.Pairs(RetryAfterTrailer, value)); got != want {
			t.Errorf("retry-after-s %q: %v, want %v", value, got, want)
		}
	}
	if got := parseRetryAfter(nil); got != 0 {
		t.Errorf("no trailer: %v", got)
	}
}

func TestErrorText(t *testing.T) {
	cases := map[codes.Code]string{
		codes.InvalidArgument: "INVALID_ARGUMENT", codes.NotFound: "NOT_FOUND", codes.OK: "OK",
		codes.ResourceExhausted: "RESOURCE_EXHAUSTED", codes.FailedPrecondition: "FAILED_PRECONDITION",
		codes.DeadlineExceeded: "DEADLINE_EXCEEDED", codes.Unavailable: "UNAVAILABLE",
	}
	for code, want := range cases {
		if got := CodeName(code); got != want {
			t.Errorf("CodeName(%v) = %q, want %q", code, got, want)
		}
	}
	e := &Error{Code: codes.InvalidArgument, Message: "workflow.stages[0].id: must not be empty"}
	if e.Field() != "workflow.stages[0].id" || !strings.HasPrefix(e.Error(), "hexgenflow: INVALID_ARGUMENT: workflow") {
		t.Errorf("Field %q, Error %q", e.Field(), e.Error())
	}
	if (&Error{Code: codes.Unavailable, Message: "a: b"}).Field() != "" {
		t.Error("Field of an UNAVAILABLE error")
	}
	if (&Error{Code: codes.NotFound, Message: "no query 'x': gone"}).Field() != "" {
		t.Error("Field of a message that does not start with a field path")
	}
	if errors.Is(e, ErrNotFound) || !errors.Is(e, ErrInvalidArgument) {
		t.Error("Is by code")
	}
	if Code(nil) != codes.OK || Code(errors.New("x")) != codes.Unknown {
		t.Error("Code of nil / a plain error")
	}
}

func TestAPIKeySources(t *testing.T) {
	t.Setenv(APIKeyEnv, "from-env")
	t.Setenv(TLSCAEnv, "")
	one(t, sent(context.Background()), "authorization", "Bearer from-env")
	one(t, sent(context.Background(), WithAPIKey("given")), "authorization", "Bearer given")
	if got := sent(context.Background(), WithAPIKey("")).Get("authorization"); len(got) != 0 {
		t.Errorf("WithAPIKey(\"\") sent %v", got)
	}

	dir := t.TempDir()
	file := filepath.Join(dir, "a.key")
	if err := os.WriteFile(file, []byte("  from-file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	one(t, sent(context.Background(), WithAPIKeyFile(file)), "authorization", "Bearer from-file")
	// The last of WithAPIKey and WithAPIKeyFile wins.
	one(t, sent(context.Background(), WithAPIKeyFile(file), WithAPIKey("given")), "authorization", "Bearer given")

	t.Setenv(APIKeyEnv, "")
	if got := sent(context.Background()).Get("authorization"); len(got) != 0 {
		t.Errorf("no key anywhere, sent %v", got)
	}
	for _, opt := range []Option{WithAPIKeyFile(filepath.Join(dir, "missing.key")), WithAPIKeyFile(filepath.Join(dir, "empty.key"))} {
		_ = os.WriteFile(filepath.Join(dir, "empty.key"), []byte("\n"), 0o600)
		if _, err := Dial(context.Background(), "127.0.0.1:1", opt); err == nil {
			t.Error("Dial with an unreadable or empty key file succeeded")
		}
	}
}

func TestTLSCASources(t *testing.T) {
	resolved := func(opts ...Option) (*options, error) {
		o := &options{}
		for _, opt := range opts {
			opt(o)
		}
		return o, o.resolve()
	}
	t.Setenv(TLSCAEnv, "")
	if o, err := resolved(); err != nil || o.creds != nil {
		t.Errorf("no CA: creds %v, err %v; want plaintext", o.creds, err)
	}
	missing := filepath.Join(t.TempDir(), "ca.pem")
	if _, err := resolved(WithTLSCA(missing)); err == nil || !strings.Contains(err.Error(), "TLS CA") {
		t.Errorf("a missing CA file: err %v", err)
	}
	t.Setenv(TLSCAEnv, missing)
	if _, err := resolved(); err == nil {
		t.Error("a missing CA file from the environment: no error")
	}
	if o, err := resolved(WithTLSCA("")); err != nil || o.creds != nil {
		t.Errorf(`WithTLSCA(""): creds %v, err %v; want plaintext`, o.creds, err)
	}
	if o, err := resolved(WithTLS(nil)); err != nil || o.creds == nil {
		t.Errorf("WithTLS wins over the environment's CA: creds %v, err %v", o.creds, err)
	}
	if _, err := Dial(context.Background(), "127.0.0.1:1", WithTLSCA(missing)); err == nil {
		t.Error("Dial with a missing CA file succeeded")
	}
}
