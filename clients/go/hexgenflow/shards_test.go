package hexgenflow_test

// Shard routing against real servers. Those of HEXGEN_COORDINATOR_SHARDED run only when it
// is set: the comma list of a sharded mesh's coordinators, shard k's first
// (`hexgen-flow up --shards 2 --spares 0` prints it; scripts/test_clients.py starts one).
// Workflows of both shards go in through one address (those of the other shard are
// redirected) and through the comma list with a dead address in front, and all complete.
//
// Those of HEXGEN_SHARD_FIXTURES run only when it is set: the JSON line that
// `python tests/shard_redirect_server.py` prints (scripts/test_clients.py starts it), the
// addresses of small gRPC servers that redirect as coordinators do but are set up to
// disagree: a circle of redirects ("loop"), a chain longer than a client follows
// ("chain"), a shard without a holder ("takeover"), and two shards of one table
// ("shards"; a query submitted there stays RUNNING, and a session's call is answered
// "ADDRESS answers PROMPT" by the coordinator that served it).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflow"
	pb "github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflowv1"
	"google.golang.org/grpc/codes"
)

// shardOf is the shard that owns queryID among shards: the coordinators' rule,
// crc32(UTF-8 id) mod N (the client itself needs no such map: it learns from redirects).
func shardOf(queryID string, shards int) int {
	return int(crc32.ChecksumIEEE([]byte(queryID)) % uint32(shards))
}

// idsOf is count fresh query ids of each of the shards, by shard.
func idsOf(t *testing.T, stem string, shards, count int) [][]string {
	out := make([][]string, shards)
	for k := 0; ; k++ {
		queryID := id(t, fmt.Sprintf("-%s-%d", stem, k))
		s := shardOf(queryID, shards)
		if len(out[s]) < count {
			out[s] = append(out[s], queryID)
		}
		done := true
		for _, ids := range out {
			done = done && len(ids) == count
		}
		if done {
			return out
		}
	}
}

// deadAddress is a loopback address where nothing listens.
func deadAddress(t *testing.T) string {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	return addr
}

func dialed(t *testing.T, ctx context.Context, addrs ...string) *hexgenflow.Client {
	t.Helper()
	c, err := hexgenflow.DialAddresses(ctx, addrs)
	if err != nil {
		t.Fatalf("Dial(%v): %v", addrs, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// ------------------------------------------------------------------ a sharded mesh

func TestLiveShards(t *testing.T) {
	list := os.Getenv("HEXGEN_COORDINATOR_SHARDED")
	if list == "" {
		t.Skip("HEXGEN_COORDINATOR_SHARDED is not set: no sharded mesh to test against")
	}
	addrs := strings.Split(list, ",")
	if len(addrs) != 2 {
		t.Fatalf("HEXGEN_COORDINATOR_SHARDED=%s: want the two coordinators of `up --shards 2 --spares 0`", list)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	// Through the first coordinator alone: the second shard's workflows are redirected.
	one := dialed(t, ctx, addrs[0])
	ready, readyCancel := context.WithTimeout(ctx, 30*time.Second)
	defer readyCancel()
	if _, err := one.WaitReady(ready); err != nil {
		t.Fatalf("the sharded mesh at %s is not ready: %v", list, err)
	}
	ids := idsOf(t, "one", 2, 3)
	runAll(t, ctx, one, append(append([]string(nil), ids[0]...), ids[1]...))
	for shard, of := range ids {
		for _, queryID := range of {
			want := "" // its own shard's: never redirected, no owner learnt
			if shard == 1 {
				want = addrs[1]
			}
			if got := one.Router().Owner(queryID); got != want {
				t.Errorf("owner of %s (shard %d): %q, want %q", queryID, shard, got, want)
			}
		}
	}

	// A session of the second shard: opened through a redirect, its call and close go to
	// the owner straight.
	session := idsOf(t, "session", 2, 1)[1][0]
	if _, err := one.OpenWorkflow(ctx, hexgenflow.Session{ID: session, SLOScale: 5, Expected: &pb.Workflow{
		Stages: []*pb.Stage{{Id: "plan", Step: "plan", Calls: []*pb.LLMCall{call(300, 16)}}},
	}}); err != nil {
		t.Fatal(err)
	}
	calls, err := one.RunCall(ctx, session, "plan", hexgenflow.Call{Prompt: "hello", MaxTokens: 16})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := calls.All(); err != nil || calls.Last().GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_CALL_FINISHED {
		t.Fatalf("RunCall through the owner: %v, last %v", err, calls.Last().GetKind())
	}
	if _, err := one.CloseWorkflow(ctx, session); err != nil {
		t.Fatal(err)
	}
	watched, err := one.Watch(ctx, session)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watched.All(); err != nil || watched.Last().GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_SUCCEEDED {
		t.Fatalf("the session: %v, ended %v", err, watched.Last().GetKind())
	}

	// Through the comma list with a dead address in front: passed over, and every workflow
	// completes, those submitted before too (found through redirects by a fresh client).
	dead := deadAddress(t)
	all := dialed(t, ctx, dead+","+list)
	more := idsOf(t, "all", 2, 2)
	runAll(t, ctx, all, append(append([]string(nil), more[0]...), more[1]...))
	if all.Router().Default() != addrs[0] {
		t.Errorf("the default after the dead address: %s, want %s", all.Router().Default(), addrs[0])
	}
	for _, queryID := range append(ids[0], ids[1]...) {
		got, err := all.Get(ctx, queryID)
		if err != nil || got.GetQuery().GetState() != pb.QueryState_QUERY_STATE_SUCCEEDED {
			t.Errorf("Get(%s) through the comma list: %v, %v", queryID, got.GetQuery().GetState(), err)
		}
	}
	for _, queryID := range more[1] {
		if got := all.Router().Owner(queryID); got != addrs[1] {
			t.Errorf("owner of %s: %q, want %s", queryID, got, addrs[1])
		}
	}
}

// runAll runs the workflows queryIDs at once through c, half by Submit then Watch, half by
// Run, and checks that each succeeded.
func runAll(t *testing.T, ctx context.Context, c *hexgenflow.Client, queryIDs []string) {
	t.Helper()
	var wg sync.WaitGroup
	for k, queryID := range queryIDs {
		wg.Add(1)
		go func(k int, queryID string) {
			defer wg.Done()
			q := hexgenflow.Query{ID: queryID, Workflow: smallWorkflow(), SLOScale: 5}
			var events *hexgenflow.Events
			var err error
			if k%2 == 0 {
				if _, err = c.Submit(ctx, q); err == nil {
					events, err = c.Watch(ctx, queryID)
				}
			} else {
				events, err = c.Run(ctx, q)
			}
			if err == nil {
				_, err = events.All()
			}
			if err != nil {
				t.Errorf("%s (shard %d): %v", queryID, shardOf(queryID, 2), err)
			} else if kind := events.Last().GetKind(); kind != pb.QueryEventKind_QUERY_EVENT_KIND_SUCCEEDED {
				t.Errorf("%s ended %v", queryID, kind)
			}
		}(k, queryID)
	}
	wg.Wait()
}

// ------------------------------------------------- servers that redirect in circles

type shardFixtures struct {
	Loop, Chain, Takeover, Shards, Query string
}

func fixtures(t *testing.T) (shardFixtures, context.Context) {
	t.Helper()
	raw := os.Getenv("HEXGEN_SHARD_FIXTURES")
	if raw == "" {
		t.Skip("HEXGEN_SHARD_FIXTURES is not set (the JSON line of `python tests/shard_redirect_server.py`)")
	}
	var f shardFixtures
	if err := json.Unmarshal([]byte(raw), &f); err != nil {
		t.Fatalf("HEXGEN_SHARD_FIXTURES: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return f, ctx
}

func TestShardRedirectLoop(t *testing.T) {
	f, ctx := fixtures(t)
	loop := strings.Split(f.Loop, ",")
	c := dialed(t, ctx, loop...)
	_, err := c.Get(ctx, f.Query)
	var e *hexgenflow.ShardRedirectLoopError
	if !errors.As(err, &e) || !errors.Is(err, hexgenflow.ErrShardRedirectLoop) {
		t.Fatalf("Get through two coordinators that name each other: %v, want a *ShardRedirectLoopError", err)
	}
	hops := loop[0] + " -> " + loop[1] + " -> " + loop[0]
	want := fmt.Sprintf("hexgenflow: query '%s': the coordinators keep redirecting it (%s); do they all run with the same --shards?", f.Query, hops)
	if !strings.HasPrefix(err.Error(), want) || hexgenflow.Code(err) != codes.FailedPrecondition || e.QueryID != f.Query {
		t.Fatalf("error %q (code %v), want it to start with %q", err, hexgenflow.Code(err), want)
	}
	// Streams likewise, before their first event.
	if _, err := c.Watch(ctx, f.Query); !errors.Is(err, hexgenflow.ErrShardRedirectLoop) {
		t.Fatalf("Watch: %v, want a redirect loop", err)
	}
	if _, err := c.RunCall(ctx, f.Query, "plan", hexgenflow.Call{Prompt: "hi"}); !errors.Is(err, hexgenflow.ErrShardRedirectLoop) {
		t.Fatalf("RunCall: %v, want a redirect loop", err)
	}
	t.Log(err)
}

func TestShardRedirectChainStops(t *testing.T) {
	f, ctx := fixtures(t)
	chain := strings.Split(f.Chain, ",")
	if len(chain) != hexgenflow.MaxRedirects+2 {
		t.Fatalf("a chain of %d coordinators, want %d", len(chain), hexgenflow.MaxRedirects+2)
	}
	_, err := dialed(t, ctx, chain[0]).Get(ctx, f.Query)
	var e *hexgenflow.ShardRedirectLoopError
	if !errors.As(err, &e) || strings.Join(e.Hops, ",") != f.Chain {
		t.Fatalf("Get along a chain: %v, want a redirect loop naming every hop (%s)", err, f.Chain)
	}
}

func TestShardWithoutHolderFallsOver(t *testing.T) {
	f, ctx := fixtures(t)
	dead := deadAddress(t)
	c := dialed(t, ctx, f.Takeover, dead)
	_, err := c.Get(ctx, f.Query)
	var e *hexgenflow.Error
	if !errors.As(err, &e) || e.Code != codes.Unavailable || e.Address != f.Takeover+","+dead {
		t.Fatalf("Get: %#v, want UNAVAILABLE from both", err)
	}
	want := fmt.Sprintf("no coordinator can serve query '%s' now (%s: shard 1 (hf:{s1}:) has no coordinator now; %s: no answer)", f.Query, f.Takeover, dead)
	if !strings.HasPrefix(e.Message, want) {
		t.Fatalf("message %q, want it to start with %q", e.Message, want)
	}
	if c.Router().Default() != f.Takeover {
		t.Errorf("default %s: the coordinator that answered UNAVAILABLE runs, and stays the first asked", c.Router().Default())
	}
	if _, err := c.Watch(ctx, f.Query); !errors.Is(err, hexgenflow.ErrUnavailable) {
		t.Errorf("Watch: %v, want UNAVAILABLE", err)
	}
	// One address: its own answer, as without shards.
	_, err = dialed(t, ctx, f.Takeover).Get(ctx, f.Query)
	if !errors.As(err, &e) || e.Code != codes.Unavailable || e.Message != "shard 1 (hf:{s1}:) has no coordinator now" {
		t.Fatalf("Get through the one coordinator: %v", err)
	}
}

func TestShardRedirectsAreFollowedAndRemembered(t *testing.T) {
	f, ctx := fixtures(t)
	pair := strings.Split(f.Shards, ",")
	ids := idsOf(t, "fixture", 2, 1)
	theirs := ids[1][0]
	// Given a dead address and the first coordinator only, it reaches the second.
	dead := deadAddress(t)
	c := dialed(t, ctx, dead, pair[0])
	blocked, err := hexgenflow.DialAddresses(ctx, []string{dead, pair[0]}, hexgenflow.WithBlock())
	if err != nil || blocked.Router().Default() != pair[0] {
		t.Fatalf("DialAddresses WithBlock: %v; want the connected address as the default", err)
	}
	blocked.Close()
	if _, err := c.Status(ctx); err != nil || c.Router().Default() != pair[0] {
		t.Fatalf("Status: %v, default %s (want the dead address passed over)", err, c.Router().Default())
	}
	resp, err := c.Submit(ctx, hexgenflow.Query{ID: theirs, Workflow: smallWorkflow()})
	if err != nil || !resp.GetCreated() || c.Router().Owner(theirs) != pair[1] {
		t.Fatalf("Submit: %v, %v; owner %q, want %s", resp, err, c.Router().Owner(theirs), pair[1])
	}
	events, err := c.Watch(ctx, theirs)
	if err != nil {
		t.Fatal(err)
	}
	if ev, err := events.Next(); err != nil || ev.GetKind() != pb.QueryEventKind_QUERY_EVENT_KIND_SUBMITTED {
		t.Fatalf("Watch: %v, %v", ev, err)
	}
	events.Close()
	if info, err := c.Cancel(ctx, theirs); err != nil || info.GetState() != pb.QueryState_QUERY_STATE_CANCELLED {
		t.Fatalf("Cancel: %v, %v", info, err)
	}

	// A session: each RPC at the owner, whose answer names it.
	session := idsOf(t, "fixture-session", 2, 1)[1][0]
	if _, err := c.OpenWorkflow(ctx, hexgenflow.Session{ID: session, Template: "chess"}); err != nil {
		t.Fatal(err)
	}
	calls, err := c.RunCall(ctx, session, "plan", hexgenflow.Call{Prompt: "hello"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := calls.All(); err != nil || calls.Text() != pair[1]+" answers hello" {
		t.Fatalf("RunCall: %v, text %q, want the owner's answer", err, calls.Text())
	}
	if info, err := c.CloseWorkflow(ctx, session); err != nil || info.GetState() != pb.QueryState_QUERY_STATE_SUCCEEDED {
		t.Fatalf("CloseWorkflow: %v, %v", info, err)
	}
}
