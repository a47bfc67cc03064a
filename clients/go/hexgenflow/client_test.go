package hexgenflow_test

// Live tests against running coordinators. Those of HEXGEN_COORDINATOR (host:port, e.g.
// what `hexgen-flow up --listen 127.0.0.1:0` prints) run only when it is set; those of
// HEXGEN_COORDINATOR_LIMITED only when that is set: a coordinator started with
// `--max-running-queries 1 --admission off` and no worker (scripts/test_clients.py starts
// one), where the query a test submits stays running, the next submission is refused with
// a retry-after hint and a watch never ends by itself. Each test there cancels its query.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflow"
	pb "github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflowv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func liveClient(t *testing.T, opts ...hexgenflow.Option) (*hexgenflow.Client, context.Context) {
	t.Helper()
	addr := os.Getenv("HEXGEN_COORDINATOR")
	if addr == "" {
		t.Skip("HEXGEN_COORDINATOR is not set: no live coordinator to test against")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	c, err := hexgenflow.Dial(ctx, addr, opts...)
	if err != nil {
		t.Fatalf("Dial(%s): %v", addr, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	readyOnce.Do(func() {
		ready, readyCancel := context.WithTimeout(ctx, 30*time.Second)
		defer readyCancel()
		_, readyErr = c.WaitReady(ready)
	})
	if readyErr != nil {
		t.Fatalf("the cluster at %s is not ready: %v", addr, readyErr)
	}
	return c, ctx
}

// The first live test waits for the cluster to be ready; the others fail at once if it
// was not.
var (
	readyOnce sync.Once
	readyErr  error
)

var runID = fmt.Sprintf("go-%d-%04d", time.Now().Unix(), rand.New(rand.NewSource(time.Now().UnixNano())).Intn(10000))

// id is a query id no earlier run used (finished queries stay readable for a while).
func id(t *testing.T, suffix string) string {
	return runID + "-" + strings.ReplaceAll(t.Name(), "/", "-") + suffix
}

// longSLO (cluster seconds) is an SLO longWorkflow meets on any cluster the tests run on.
const longSLO = 86_400

func call(in, out int32) *pb.LLMCall {
	return &pb.LLMCall{InputTokens: in, OutputTokens: out}
}

// smallWorkflow: keywords -> two candidates -> evaluate.
func smallWorkflow() *pb.Workflow {
	return &pb.Workflow{Stages: []*pb.Stage{
		{Id: "keywords", Step: "extract_keywords", Calls: []*pb.LLMCall{call(400, 20)}},
		{Id: "candidates", Step: "generate_candidate", Calls: []*pb.LLMCall{call(800, 60), call(800, 60)}, After: []string{"keywords"}},
		{Id: "evaluate", Step: "evaluate", Calls: []*pb.LLMCall{call(600, 10)}, After: []string{"candidates"}},
	}}
}

// longWorkflow runs long enough (many rounds of long generations) to be cancelled: about
// 1660 cluster seconds alone on `up`'s default cluster (30 rounds of 2000 tokens), so a
// query of it needs an SLO it can meet there (longSLO), not a multiple of SLO_base.
func longWorkflow() *pb.Workflow {
	return &pb.Workflow{Stages: []*pb.Stage{
		{Id: "rounds", Step: "revise", Calls: []*pb.LLMCall{call(1000, 2000)}, Repeat: 30},
	}}
}

func TestLiveClusterStatus(t *testing.T) {
	c, ctx := liveClient(t)
	// A traceparent in the metadata is accepted (the coordinator's spans join that trace).
	traced := hexgenflow.WithTraceparent(ctx, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	st, err := c.Status(traced)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.GetInstances()) == 0 || st.GetPolicy() == "" || st.GetTimeScale() <= 0 {
		t.Fatalf("unexpected status: %v", st)
	}
	for _, inst := range st.GetInstances() {
		if !inst.GetConnected() {
			t.Errorf("instance %s not connected", inst.GetName())
		}
	}
	t.Logf("cluster %s, policy %s, alpha %.2f, %d instances", st.GetCluster(), st.GetPolicy(), st.GetAlpha(), len(st.GetInstances()))
}

func TestLiveHeaders(t *testing.T) {
	// An API key, a header of the client's and per-call metadata travel with unary calls
	// and streams (what is sent: unit_test.go); a coordinator that is not secured ignores
	// the key and serves them as usual (a secured one: secure_test.go).
	c, ctx := liveClient(t, hexgenflow.WithAPIKey("k-123"), hexgenflow.WithHeader("X-Tenant-Hint", "a"))
	ctx = hexgenflow.WithMetadata(hexgenflow.WithCallAPIKey(ctx, "per-call"), "x-extra", "1")
	if _, err := c.Status(ctx); err != nil {
		t.Fatal(err)
	}
	events, err := c.Run(ctx, hexgenflow.Query{ID: id(t, ""), Workflow: smallWorkflow()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := events.All(); err != nil {
		t.Fatal(err)
	}
}

func TestLiveSubmitWatchGet(t *testing.T) {
	c, ctx := liveClient(t)
	q := hexgenflow.Query{ID: id(t, ""), Workflow: smallWorkflow(), SLOScale: 5}
	resp, err := c.Submit(ctx, q)
	if err != nil {
		t.Fatal(err)
	}
	if !resp.GetCreated() || resp.GetQuery().GetQueryId() != q.ID || resp.GetQuery().GetCallsTotal() != 4 {
		t.Fatalf("unexpected submit response: %v", resp)
	}
	again, err := c.Submit(ctx, q)
	if err != nil {
		t.Fatal(err)
	}
	if again.GetCreated() {
		t.Fatal("a second submission of the same id was created")
	}
	other := q
	other.Workflow = longWorkflow()
	if _, err := c.Submit(ctx, other); !errors.Is(err, hexgenflow.ErrAlreadyExists) {
		t.Fatalf("the same id with another workflow: %v, want ALREADY_EXISTS", err)
	}

	events, err := c.Watch(ctx, q.ID)
	if err != nil {
		t.Fatal(err)
	}
	defer events.Close()
	var seen []*pb.QueryEvent
	for {
		ev, err := events.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("after %d events: %v", len(seen), err)
		}
		if ev.GetSequence() != int64(len(seen)) {
			t.Fatalf("event %d has sequence %d", len(seen), ev.GetSequence())
		}
		seen = append(seen, ev)
	}
	if _, err := events.Next(); err != io.EOF {
		t.Fatalf("Next after the end: %v, want io.EOF", err)
	}
	if seen[0].GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED {
		t.Errorf("first event %v, want SUBMITTED", seen[0].GetKind())
	}
	if last := events.Last(); last.GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_SUCCEEDED {
		t.Fatalf("last event %v, want SUCCEEDED", last.GetKind())
	}
	finished := 0
	for _, ev := range seen {
		if ev.GetKind() == pb.QueryEventKind_QUERY_EVENT_KIND_CALL_FINISHED {
			finished++
		}
	}
	if finished != 4 {
		t.Errorf("%d CALL_FINISHED events, want 4", finished)
	}

	got, err := c.Get(ctx, q.ID)
	if err != nil {
		t.Fatal(err)
	}
	info := got.GetQuery()
	if info.GetState() != pb.QueryState_QUERY_STATE_SUCCEEDED || info.GetCallsDone() != 4 || info.GetStagesDone() != 3 {
		t.Fatalf("unexpected query: %v", info)
	}
	if len(got.GetEvents()) < len(seen) || len(got.GetStages()) != 3 {
		t.Fatalf("Get: %d events (watched %d), %d stages", len(got.GetEvents()), len(seen), len(got.GetStages()))
	}
	if got.GetStages()[1].GetName() != "candidates" || got.GetStages()[1].GetCallsDone() != 2 {
		t.Errorf("stage 1: %v", got.GetStages()[1])
	}
}

func TestLiveRun(t *testing.T) {
	c, ctx := liveClient(t)
	events, err := c.Run(ctx, hexgenflow.Query{ID: id(t, ""), Workflow: smallWorkflow()})
	if err != nil {
		t.Fatal(err)
	}
	var kinds []pb.QueryEventKind
	for ev := range events.Chan() {
		kinds = append(kinds, ev.GetKind())
	}
	if err := events.Err(); err != nil {
		t.Fatal(err)
	}
	if len(kinds) < 3 || kinds[0] != pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED ||
		kinds[len(kinds)-1] != pb.QueryEventKind_QUERY_EVENT_KIND_SUCCEEDED {
		t.Fatalf("events: %v", kinds)
	}
}

func TestLiveCancel(t *testing.T) {
	c, ctx := liveClient(t)
	// An SLO of a day: with SLOScale 10 (820 s on the default cluster) a coordinator with
	// admission control (`up`'s default) refused the query, which needs about 1658 s even
	// alone: INVALID_ARGUMENT, or RESOURCE_EXHAUSTED with a larger --admission-slack.
	q := hexgenflow.Query{ID: id(t, ""), Workflow: longWorkflow(), SLOSeconds: longSLO}
	if _, err := c.Submit(ctx, q); err != nil {
		t.Fatal(err)
	}
	info, err := c.Cancel(ctx, q.ID)
	if err != nil {
		t.Fatal(err)
	}
	if info.GetState() != pb.QueryState_QUERY_STATE_CANCELLED {
		t.Fatalf("state after Cancel: %v", info.GetState())
	}
	events, err := c.Watch(ctx, q.ID)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := events.All(); err != nil {
		t.Fatal(err)
	}
	if k := events.Last().GetKind(); k != pb.QueryEventKind_QUERY_EVENT_KIND_CANCELLED {
		t.Fatalf("last event %v, want CANCELLED", k)
	}
}

func TestLiveInvalidArgument(t *testing.T) {
	c, ctx := liveClient(t)
	wf := smallWorkflow()
	wf.Stages[1].Calls[1].OutputTokens = 0
	_, err := c.Submit(ctx, hexgenflow.Query{ID: id(t, ""), Workflow: wf})
	const field = "workflow.stages[1].calls[1].output_tokens"
	var e *hexgenflow.Error
	if !errors.As(err, &e) {
		t.Fatalf("Submit: %v (%T), want *hexgenflow.Error", err, err)
	}
	if !errors.Is(err, hexgenflow.ErrInvalidArgument) || e.Code != codes.InvalidArgument || hexgenflow.Code(err) != codes.InvalidArgument {
		t.Fatalf("Submit: %v, want INVALID_ARGUMENT", err)
	}
	if errors.Is(err, hexgenflow.ErrNotFound) {
		t.Fatal("an INVALID_ARGUMENT error matched ErrNotFound")
	}
	if e.Field() != field || !strings.Contains(e.Message, field) || !strings.Contains(err.Error(), "INVALID_ARGUMENT") {
		t.Fatalf("Field() %q, message %q, want the field %s", e.Field(), e.Message, field)
	}

	// Through RunQuery the field is under `query.`, and the error is Run's own.
	_, err = c.Run(ctx, hexgenflow.Query{ID: id(t, "-run"), Workflow: wf})
	if !errors.Is(err, hexgenflow.ErrInvalidArgument) || !errors.As(err, &e) || e.Field() != "query."+field {
		t.Fatalf("Run: %v, want INVALID_ARGUMENT naming query.%s", err, field)
	}

	_, err = c.Submit(ctx, hexgenflow.Query{ID: "", Workflow: smallWorkflow()})
	if !errors.As(err, &e) || e.Code != codes.InvalidArgument || e.Field() != "query_id" {
		t.Fatalf("an empty id: %v, want INVALID_ARGUMENT naming query_id", err)
	}
}

func TestLiveNotFound(t *testing.T) {
	c, ctx := liveClient(t)
	unknown := id(t, "-never-submitted")
	if _, err := c.Get(ctx, unknown); !errors.Is(err, hexgenflow.ErrNotFound) {
		t.Fatalf("Get: %v, want NOT_FOUND", err)
	}
	var e *hexgenflow.Error
	if _, err := c.Watch(ctx, unknown); !errors.As(err, &e) || e.Code != codes.NotFound || e.Field() != "query_id" || !strings.Contains(e.Message, unknown) {
		t.Fatalf("Watch: %v, want NOT_FOUND naming the id", err)
	}
	if _, err := c.Cancel(ctx, unknown); !errors.Is(err, hexgenflow.ErrNotFound) {
		t.Fatalf("Cancel: %v, want NOT_FOUND", err)
	}
	if _, err := c.RunCall(ctx, unknown, "chat", hexgenflow.Call{Prompt: "hi", MaxTokens: 8}); !errors.Is(err, hexgenflow.ErrNotFound) {
		t.Fatalf("RunCall: %v, want NOT_FOUND", err)
	}
}

func TestLiveSession(t *testing.T) {
	c, ctx := liveClient(t)
	wid := id(t, "")
	open, err := c.OpenWorkflow(ctx, hexgenflow.Session{
		ID: wid,
		Expected: &pb.Workflow{Stages: []*pb.Stage{
			{Id: "plan", Step: "plan", Calls: []*pb.LLMCall{call(300, 40)}},
			{Id: "answer", Step: "answer", Calls: []*pb.LLMCall{call(500, 80)}, After: []string{"plan"}},
		}},
		SLOScale: 5,
	})
	if err != nil {
		t.Fatal(err)
	}
	if !open.GetCreated() || !open.GetWorkflow().GetSession() || !open.GetWorkflow().GetSessionOpen() {
		t.Fatalf("unexpected OpenWorkflow response: %v", open)
	}

	for _, stage := range []string{"plan", "answer"} {
		events, err := c.RunCall(ctx, wid, stage, hexgenflow.Call{Prompt: "the " + stage + " prompt", MaxTokens: 32})
		if err != nil {
			t.Fatalf("RunCall(%s): %v", stage, err)
		}
		all, err := events.All()
		if err != nil {
			t.Fatalf("RunCall(%s): %v", stage, err)
		}
		last := events.Last()
		if events.CallID == "" || events.DeadlineS <= 0 {
			t.Errorf("RunCall(%s): call id %q, deadline %v", stage, events.CallID, events.DeadlineS)
		}
		if last.GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_CALL_FINISHED || last.GetCallId() != events.CallID {
			t.Fatalf("RunCall(%s) ended with %v of %q (%d events), want CALL_FINISHED of %q", stage, last.GetKind(), last.GetCallId(), len(all), events.CallID)
		}
		t.Logf("%s: call %s, %d events, text %q", stage, events.CallID, len(all), events.Text())
	}

	info, err := c.CloseWorkflow(ctx, wid)
	if err != nil {
		t.Fatal(err)
	}
	if info.GetSessionOpen() {
		t.Errorf("the session is still open after CloseWorkflow: %v", info)
	}
	// A call after the close is refused.
	if _, err := c.RunCall(ctx, wid, "answer", hexgenflow.Call{Prompt: "late", MaxTokens: 8}); !errors.Is(err, hexgenflow.ErrFailedPrecondition) {
		t.Errorf("RunCall after CloseWorkflow: %v, want FAILED_PRECONDITION", err)
	}

	events, err := c.Watch(ctx, wid)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := events.All(); err != nil {
		t.Fatal(err)
	}
	if k := events.Last().GetKind(); k != pb.QueryEventKind_QUERY_EVENT_KIND_SUCCEEDED {
		t.Fatalf("the session ended %v, want SUCCEEDED", k)
	}
	got, err := c.Get(ctx, wid)
	if err != nil {
		t.Fatal(err)
	}
	if got.GetQuery().GetState() != pb.QueryState_QUERY_STATE_SUCCEEDED {
		t.Fatalf("state %v", got.GetQuery().GetState())
	}
	var names []string
	for _, s := range got.GetStages() {
		names = append(names, s.GetName())
		if s.GetCallsDone() != 1 || s.GetCallsGiven() != 1 || s.GetFinishedS() <= 0 {
			t.Errorf("stage %s: %v", s.GetName(), s)
		}
	}
	if strings.Join(names, ",") != "plan,answer" {
		t.Fatalf("stages %v, want plan,answer", names)
	}
}

// limitedClient connects to HEXGEN_COORDINATOR_LIMITED and submits a query there, which
// stays running (no worker) until the test's cleanup cancels it. It returns the query's id.
func limitedClient(t *testing.T) (*hexgenflow.Client, context.Context, string) {
	t.Helper()
	addr := os.Getenv("HEXGEN_COORDINATOR_LIMITED")
	if addr == "" {
		t.Skip("HEXGEN_COORDINATOR_LIMITED is not set: no coordinator with --max-running-queries 1 to test against")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	c, err := hexgenflow.Dial(ctx, addr)
	if err != nil {
		t.Fatalf("Dial(%s): %v", addr, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	running := id(t, "-running")
	resp, err := c.Submit(ctx, hexgenflow.Query{ID: running, Workflow: smallWorkflow(), SLOScale: 5})
	if err != nil {
		t.Fatalf("the limited coordinator at %s refused the test's query (is its one slot held by another query?): %v", addr, err)
	}
	if !resp.GetCreated() || resp.GetQuery().GetState() != pb.QueryState_QUERY_STATE_RUNNING {
		t.Fatalf("unexpected submit response: %v", resp)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := c.Cancel(ctx, running); err != nil {
			t.Errorf("cancelling %s: %v", running, err)
		}
	})
	return c, ctx, running
}

func TestLiveRetryAfter(t *testing.T) {
	c, ctx, running := limitedClient(t)
	second := hexgenflow.Query{ID: id(t, "-second"), Workflow: smallWorkflow()}
	_, err := c.Submit(ctx, second)
	var e *hexgenflow.Error
	if !errors.As(err, &e) || !errors.Is(err, hexgenflow.ErrResourceExhausted) || e.Code != codes.ResourceExhausted {
		t.Fatalf("a second Submit: %v, want RESOURCE_EXHAUSTED", err)
	}
	if e.RetryAfter <= 0 || !e.Retryable() || !strings.Contains(e.Message, "queries are running") {
		t.Fatalf("RetryAfter %v, Retryable %v, message %q", e.RetryAfter, e.Retryable(), e.Message)
	}
	if d, ok := hexgenflow.RetryAfter(err); !ok || d != e.RetryAfter {
		t.Fatalf("RetryAfter(err) = %v, %v", d, ok)
	}
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("status.Code: %v", status.Code(err))
	}
	t.Logf("refused: %v (retry after %v)", err, e.RetryAfter)

	// A stream's refusal is Run's own error, with the hint from the stream's trailer.
	_, err = c.Run(ctx, second)
	if d, ok := hexgenflow.RetryAfter(err); !errors.Is(err, hexgenflow.ErrResourceExhausted) || !ok || d <= 0 {
		t.Fatalf("Run: %v, retry after %v %v", err, d, ok)
	}
	// Nothing was stored for the refused id.
	if _, err := c.Get(ctx, second.ID); !errors.Is(err, hexgenflow.ErrNotFound) {
		t.Fatalf("Get of the refused query: %v, want NOT_FOUND", err)
	}

	// Once the running query ends, the same submission is admitted.
	if _, err := c.Cancel(ctx, running); err != nil {
		t.Fatal(err)
	}
	resp, err := c.Submit(ctx, second)
	if err != nil || !resp.GetCreated() {
		t.Fatalf("Submit after the slot freed: %v, %v", resp, err)
	}
	if _, err := c.Cancel(ctx, second.ID); err != nil {
		t.Fatal(err)
	}
}

func TestLiveDeadline(t *testing.T) {
	c, ctx, running := limitedClient(t)
	// A unary call past its deadline.
	late, cancelLate := context.WithTimeout(ctx, time.Nanosecond)
	defer cancelLate()
	<-late.Done()
	if _, err := c.Get(late, running); hexgenflow.Code(err) != codes.DeadlineExceeded || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Get past its deadline: %v, want DEADLINE_EXCEEDED", err)
	}

	// A watch of a query that stays running ends with DEADLINE_EXCEEDED: the events before
	// it, then the error (or the error of Watch itself if it came before the first event).
	short, cancelShort := context.WithTimeout(ctx, 400*time.Millisecond)
	defer cancelShort()
	events, err := c.Watch(short, running)
	var seen []*pb.QueryEvent
	if err == nil {
		seen, err = events.All()
	}
	var e *hexgenflow.Error
	if !errors.As(err, &e) || e.Code != codes.DeadlineExceeded || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("watching a running query with a 400 ms deadline: %v after %d events, want DEADLINE_EXCEEDED", err, len(seen))
	}
	if events != nil {
		if len(seen) == 0 || seen[0].GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED {
			t.Fatalf("events before the deadline: %v", seen)
		}
		if events.Err() != err {
			t.Fatalf("Err %v, want %v", events.Err(), err)
		}
	}
	t.Logf("%d events, then %v", len(seen), err)

	// The query itself goes on.
	got, err := c.Get(ctx, running)
	if err != nil || got.GetQuery().GetState() != pb.QueryState_QUERY_STATE_RUNNING {
		t.Fatalf("Get after the watch: %v, %v", got.GetQuery(), err)
	}
}

func TestLiveCloseAndCancel(t *testing.T) {
	c, ctx, running := limitedClient(t)
	// Close a stream that is waiting for an event.
	events, err := c.Watch(ctx, running)
	if err != nil {
		t.Fatal(err)
	}
	if ev, err := events.Next(); err != nil || ev.GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED {
		t.Fatalf("first event: %v, %v", ev, err)
	}
	go func() {
		time.Sleep(50 * time.Millisecond)
		events.Close()
	}()
	for {
		_, err := events.Next()
		if err == nil {
			continue // the released stage and the parked call's events
		}
		if !errors.Is(err, context.Canceled) || hexgenflow.Code(err) != codes.Canceled {
			t.Fatalf("Next after Close: %v, want CANCELED", err)
		}
		break
	}

	// Cancel the context of a stream read through Chan.
	cctx, cancel := context.WithCancel(ctx)
	events, err = c.Watch(cctx, running)
	if err != nil {
		t.Fatal(err)
	}
	ch := events.Chan()
	if ev := <-ch; ev.GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED {
		t.Fatalf("first event on the channel: %v", ev)
	}
	cancel()
	for range ch {
	}
	if err := events.Err(); !errors.Is(err, context.Canceled) || hexgenflow.Code(err) != codes.Canceled {
		t.Fatalf("Err after cancel: %v, want CANCELED", err)
	}

	// Stop Each early with an error of the callback's.
	stop := errors.New("enough")
	events, err = c.Watch(ctx, running)
	if err != nil {
		t.Fatal(err)
	}
	if err := events.Each(func(*pb.QueryEvent) error { return stop }); err != stop {
		t.Fatalf("Each: %v, want the callback's error", err)
	}

	// The streams ended, not the query, and the client still works.
	got, err := c.Get(ctx, running)
	if err != nil || got.GetQuery().GetState() != pb.QueryState_QUERY_STATE_RUNNING {
		t.Fatalf("Get after the streams ended: %v, %v", got.GetQuery(), err)
	}
}

func TestUnavailable(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close() // nothing listens there now
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := hexgenflow.Dial(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.Status(ctx)
	var e *hexgenflow.Error
	if !errors.As(err, &e) || !errors.Is(err, hexgenflow.ErrUnavailable) || !e.Retryable() {
		t.Fatalf("Status: %v, want UNAVAILABLE", err)
	}

	short, cancelShort := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancelShort()
	if _, err := hexgenflow.Dial(short, addr, hexgenflow.WithBlock()); !errors.Is(err, hexgenflow.ErrUnavailable) {
		t.Fatalf("Dial WithBlock: %v, want UNAVAILABLE", err)
	}
}
