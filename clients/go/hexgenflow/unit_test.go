package hexgenflow

// Unit tests that need no server: the metadata a call sends (headers, per-call metadata,
// the traceparent of WithTraceparent or of an OpenTelemetry span), parsing the
// retry-after trailer, error texts. What the coordinator does with them is tested live
// (client_test.go, and tests/test_client_traces.py for the traceparent).

import (
	"context"
	"errors"
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
	one(t, md, "x-api-key", "k-123")
	one(t, md, "x-tenant-hint", "a")
	one(t, md, TraceparentHeader, tp)

	// Per-call metadata wins over the client's header of the same key.
	md = sent(WithMetadata(context.Background(), "x-api-key", "per-call"), opts...)
	one(t, md, "x-api-key", "per-call")
	one(t, md, "x-tenant-hint", "a")

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
