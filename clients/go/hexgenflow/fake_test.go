package hexgenflow_test

// Offline tests against an in-process fake coordinator: they always run.

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflow"
	pb "github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflowv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

type fakeCoordinator struct {
	pb.UnimplementedCoordinatorServiceServer
	seen chan metadata.MD // the incoming metadata of every call
}

func (f *fakeCoordinator) record(ctx context.Context) {
	md, _ := metadata.FromIncomingContext(ctx)
	select {
	case f.seen <- md:
	default:
	}
}

func (f *fakeCoordinator) ClusterStatus(ctx context.Context, _ *pb.ClusterStatusRequest) (*pb.ClusterStatusResponse, error) {
	f.record(ctx)
	return &pb.ClusterStatusResponse{Policy: "fake", Instances: []*pb.InstanceStatus{{Name: "A100#0", Connected: true}}}, nil
}

// SubmitQuery refuses everything with a retry-after hint.
func (f *fakeCoordinator) SubmitQuery(ctx context.Context, _ *pb.SubmitQueryRequest) (*pb.SubmitQueryResponse, error) {
	f.record(ctx)
	_ = grpc.SetTrailer(ctx, metadata.Pairs("retry-after-s", "2.5"))
	return nil, status.Error(codes.ResourceExhausted, "the cluster is predicted to miss the SLO")
}

// WatchQuery: "ok" succeeds after three events, "broken" fails after one, "slow" never
// ends, "gone" ends without a terminal event.
func (f *fakeCoordinator) WatchQuery(req *pb.WatchQueryRequest, stream pb.CoordinatorService_WatchQueryServer) error {
	f.record(stream.Context())
	send := func(seq int64, kind pb.QueryEventKind) error {
		return stream.Send(&pb.WatchQueryResponse{Event: &pb.QueryEvent{QueryId: req.GetQueryId(), Kind: kind, Sequence: seq}})
	}
	switch req.GetQueryId() {
	case "ok":
		_ = send(0, pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED)
		_ = send(1, pb.QueryEventKind_QUERY_EVENT_KIND_STAGE_RELEASED)
		_ = send(2, pb.QueryEventKind_QUERY_EVENT_KIND_SUCCEEDED)
		// Anything after the terminal event is not read.
		_ = send(3, pb.QueryEventKind_QUERY_EVENT_KIND_CLOSED)
		return nil
	case "broken":
		_ = send(0, pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED)
		return status.Error(codes.Unavailable, "redis: connection refused")
	case "slow":
		_ = send(0, pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED)
		<-stream.Context().Done()
		return stream.Context().Err()
	case "gone":
		_ = send(0, pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED)
		return nil
	}
	return status.Errorf(codes.NotFound, "query_id: no query '%s'", req.GetQueryId())
}

// RunQuery refuses with a retry-after hint, in the trailer of a stream.
func (f *fakeCoordinator) RunQuery(_ *pb.RunQueryRequest, stream pb.CoordinatorService_RunQueryServer) error {
	stream.SetTrailer(metadata.Pairs("retry-after-s", "0.25"))
	return status.Error(codes.ResourceExhausted, "tenant limit")
}

func fake(t *testing.T, opts ...hexgenflow.Option) (*hexgenflow.Client, *fakeCoordinator) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := grpc.NewServer()
	f := &fakeCoordinator{seen: make(chan metadata.MD, 16)}
	pb.RegisterCoordinatorServiceServer(server, f)
	go func() { _ = server.Serve(lis) }()
	t.Cleanup(server.Stop)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := hexgenflow.Dial(ctx, lis.Addr().String(), append(opts, hexgenflow.WithBlock())...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c, f
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestHeadersAndTraceparent(t *testing.T) {
	c, f := fake(t, hexgenflow.WithAPIKey("k-123"), hexgenflow.WithHeader("X-Tenant-Hint", "a"))
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ctx := hexgenflow.WithTraceparent(testContext(t), tp)
	if _, err := c.Status(ctx); err != nil {
		t.Fatal(err)
	}
	md := <-f.seen
	if got := md.Get("x-api-key"); len(got) != 1 || got[0] != "k-123" {
		t.Errorf("x-api-key %v", got)
	}
	if got := md.Get("x-tenant-hint"); len(got) != 1 || got[0] != "a" {
		t.Errorf("x-tenant-hint %v", got)
	}
	if got := md.Get("traceparent"); len(got) != 1 || got[0] != tp {
		t.Errorf("traceparent %v", got)
	}

	// Per-call metadata wins over the client's header of the same key; streams carry it too.
	ctx = hexgenflow.WithMetadata(testContext(t), "x-api-key", "per-call")
	events, err := c.Watch(hexgenflow.WithTraceparent(ctx, tp), "ok")
	if err != nil {
		t.Fatal(err)
	}
	events.Close()
	md = <-f.seen
	if got := md.Get("x-api-key"); len(got) != 1 || got[0] != "per-call" {
		t.Errorf("x-api-key on a stream %v", got)
	}
	if got := md.Get("traceparent"); len(got) != 1 || got[0] != tp {
		t.Errorf("traceparent on a stream %v", got)
	}

	// Without WithTraceparent nothing is sent.
	if _, err := c.Status(testContext(t)); err != nil {
		t.Fatal(err)
	}
	if got := (<-f.seen).Get("traceparent"); len(got) != 0 {
		t.Errorf("traceparent sent without one: %v", got)
	}
}

func TestRetryAfter(t *testing.T) {
	c, _ := fake(t)
	_, err := c.Submit(testContext(t), hexgenflow.Query{ID: "q"})
	var e *hexgenflow.Error
	if !errors.As(err, &e) || !errors.Is(err, hexgenflow.ErrResourceExhausted) {
		t.Fatalf("Submit: %v, want RESOURCE_EXHAUSTED", err)
	}
	if e.RetryAfter != 2500*time.Millisecond || !e.Retryable() {
		t.Fatalf("RetryAfter %v", e.RetryAfter)
	}
	if d, ok := hexgenflow.RetryAfter(err); !ok || d != 2500*time.Millisecond {
		t.Fatalf("RetryAfter(err) = %v, %v", d, ok)
	}
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("status.Code: %v", status.Code(err))
	}
	// A stream's refusal carries its trailer too.
	_, err = c.Run(testContext(t), hexgenflow.Query{ID: "q"})
	if d, ok := hexgenflow.RetryAfter(err); !ok || d != 250*time.Millisecond {
		t.Fatalf("Run: %v, retry after %v %v", err, d, ok)
	}
}

func TestEventsIterator(t *testing.T) {
	c, _ := fake(t)
	events, err := c.Watch(testContext(t), "ok")
	if err != nil {
		t.Fatal(err)
	}
	all, err := events.All()
	if err != nil || len(all) != 3 || events.Last().GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_SUCCEEDED {
		t.Fatalf("All: %d events, %v", len(all), err)
	}
	if _, err := events.Next(); err != io.EOF {
		t.Fatalf("Next after the end: %v", err)
	}
	if events.Err() != nil {
		t.Fatalf("Err after the end: %v", events.Err())
	}

	// A stream that fails: the event before, then the error.
	events, err = c.Watch(testContext(t), "broken")
	if err != nil {
		t.Fatal(err)
	}
	if ev, err := events.Next(); err != nil || ev.GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED {
		t.Fatalf("first: %v %v", ev, err)
	}
	if _, err := events.Next(); !errors.Is(err, hexgenflow.ErrUnavailable) {
		t.Fatalf("Next: %v, want UNAVAILABLE", err)
	}
	if !errors.Is(events.Err(), hexgenflow.ErrUnavailable) {
		t.Fatalf("Err: %v", events.Err())
	}

	// A stream the coordinator ends early.
	events, err = c.Watch(testContext(t), "gone")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := events.All(); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("All: %v, want io.ErrUnexpectedEOF", err)
	}

	// An unknown id is Watch's own error.
	if _, err := c.Watch(testContext(t), "nope"); !errors.Is(err, hexgenflow.ErrNotFound) {
		t.Fatalf("Watch: %v, want NOT_FOUND", err)
	}
}

func TestEventsChan(t *testing.T) {
	c, _ := fake(t)
	events, err := c.Watch(testContext(t), "ok")
	if err != nil {
		t.Fatal(err)
	}
	var kinds []pb.QueryEventKind
	for ev := range events.Chan() {
		kinds = append(kinds, ev.GetKind())
	}
	if len(kinds) != 3 || kinds[2] != pb.QueryEventKind_QUERY_EVENT_KIND_SUCCEEDED || events.Err() != nil {
		t.Fatalf("kinds %v, err %v", kinds, events.Err())
	}
}

func TestCloseAndCancel(t *testing.T) {
	c, _ := fake(t)
	events, err := c.Watch(testContext(t), "slow")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := events.Next(); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(50 * time.Millisecond)
		events.Close()
	}()
	if _, err := events.Next(); !errors.Is(err, context.Canceled) || hexgenflow.Code(err) != codes.Canceled {
		t.Fatalf("Next after Close: %v", err)
	}

	ctx, cancel := context.WithCancel(testContext(t))
	events, err = c.Watch(ctx, "slow")
	if err != nil {
		t.Fatal(err)
	}
	ch := events.Chan()
	<-ch
	cancel()
	for range ch {
	}
	if err := events.Err(); !errors.Is(err, context.Canceled) {
		t.Fatalf("Err after cancel: %v", err)
	}
}

func TestUnavailable(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close() // nothing listens there now
	c, err := hexgenflow.Dial(testContext(t), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.Status(testContext(t))
	var e *hexgenflow.Error
	if !errors.As(err, &e) || !errors.Is(err, hexgenflow.ErrUnavailable) || !e.Retryable() {
		t.Fatalf("Status: %v, want UNAVAILABLE", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := hexgenflow.Dial(ctx, addr, hexgenflow.WithBlock()); !errors.Is(err, hexgenflow.ErrUnavailable) {
		t.Fatalf("Dial WithBlock: %v, want UNAVAILABLE", err)
	}
}

func TestErrorText(t *testing.T) {
	cases := map[codes.Code]string{
		codes.InvalidArgument: "INVALID_ARGUMENT", codes.NotFound: "NOT_FOUND", codes.OK: "OK",
		codes.ResourceExhausted: "RESOURCE_EXHAUSTED", codes.FailedPrecondition: "FAILED_PRECONDITION",
		codes.DeadlineExceeded: "DEADLINE_EXCEEDED", codes.Unavailable: "UNAVAILABLE",
	}
	for code, want := range cases {
		if got := hexgenflow.CodeName(code); got != want {
			t.Errorf("CodeName(%v) = %q, want %q", code, got, want)
		}
	}
	e := &hexgenflow.Error{Code: codes.InvalidArgument, Message: "workflow.stages[0].id: must not be empty"}
	if e.Field() != "workflow.stages[0].id" || !strings.HasPrefix(e.Error(), "hexgenflow: INVALID_ARGUMENT: workflow") {
		t.Errorf("Field %q, Error %q", e.Field(), e.Error())
	}
	if (&hexgenflow.Error{Code: codes.Unavailable, Message: "a: b"}).Field() != "" {
		t.Error("Field of an UNAVAILABLE error")
	}
	if errors.Is(e, hexgenflow.ErrNotFound) || !errors.Is(e, hexgenflow.ErrInvalidArgument) {
		t.Error("Is by code")
	}
	if hexgenflow.Code(nil) != codes.OK || hexgenflow.Code(errors.New("x")) != codes.Unknown {
		t.Error("Code of nil / a plain error")
	}
}
