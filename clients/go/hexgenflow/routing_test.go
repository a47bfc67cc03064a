package hexgenflow

// Unit tests of the shard routing that need no server (routing.go; the same cases as
// tests/test_client_shards.py's for the Python client): the addresses, the router's
// memory, what a route does after a redirect, an UNAVAILABLE answer, an address that does
// not answer. Against real servers: shards_test.go.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

func redirect(queryID, owner string) *Error {
	err := status.Error(codes.FailedPrecondition, fmt.Sprintf("query '%s' belongs to shard 1 (hf:{s1}:), served at %s", queryID, owner))
	return wrap(nil, err, metadata.Pairs(ShardOwnerTrailer, owner)).(*Error)
}

func TestSplitAddresses(t *testing.T) {
	got, err := SplitAddresses("a:1, b:2,,", "c:3", "a:1")
	if err != nil || !reflect.DeepEqual(got, []string{"a:1", "b:2", "c:3"}) {
		t.Fatalf("SplitAddresses: %v, %v", got, err)
	}
	if got, err := SplitAddresses("a:1"); err != nil || !reflect.DeepEqual(got, []string{"a:1"}) {
		t.Fatalf("one address: %v, %v", got, err)
	}
	if _, err := SplitAddresses(" , "); err == nil || !strings.Contains(err.Error(), "no coordinator address") {
		t.Fatalf("no address: %v", err)
	}
	// Loopback ports where nothing listens: Dial does not block.
	c, err := Dial(context.Background(), "127.0.0.1:1, 127.0.0.1:2")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if !reflect.DeepEqual(c.Addresses(), []string{"127.0.0.1:1", "127.0.0.1:2"}) || c.Router().Default() != "127.0.0.1:1" {
		t.Fatalf("Dial of a comma list: %v, default %s", c.Addresses(), c.Router().Default())
	}
}

func TestRouterKeepsABoundedMemoryOfOwners(t *testing.T) {
	router := NewShardRouter([]string{"a:1", "b:2"}, 2)
	router.Learn("q1", "b:2")
	router.Learn("q2", "b:2")
	router.Learn("q3", "a:1")
	if got := []string{router.Owner("q1"), router.Owner("q2"), router.Owner("q3")}; !reflect.DeepEqual(got, []string{"", "b:2", "a:1"}) {
		t.Fatalf("owners %q", got)
	}
	router.WentAway("b:2")
	if router.Owner("q2") != "" || router.Default() != "a:1" {
		t.Fatalf("after b went away: owner of q2 %q, default %s", router.Owner("q2"), router.Default())
	}
	router.WentAway("a:1")
	if router.Default() != "b:2" || !reflect.DeepEqual(router.Candidates(), []string{"b:2", "a:1"}) {
		t.Fatalf("after a went away: default %s, candidates %v", router.Default(), router.Candidates())
	}
}

func TestACoordinatorThatAnswersUnavailableStaysTheDefault(t *testing.T) {
	router := NewShardRouter([]string{"a:1", "b:2", "c:3"}, 0)
	rt := router.route("q")
	takeover := &Error{Code: codes.Unavailable, Message: "shard 1 (hf:{s1}:) has no coordinator now", answered: true}
	if err := rt.reroute(takeover); err != nil || rt.address != "b:2" || router.Default() != "a:1" {
		t.Fatalf("after an answered UNAVAILABLE: %v, at %s, default %s", err, rt.address, router.Default())
	}
	router.Learn("q", "b:2")
	if err := rt.reroute(&Error{Code: codes.Unavailable, Message: "connection refused"}); err != nil || rt.address != "c:3" || router.Owner("q") != "" {
		t.Fatalf("after no answer: %v, at %s, owner %q (want forgotten)", err, rt.address, router.Owner("q"))
	}
	err := rt.reroute(&Error{Code: codes.Unavailable, Message: "connection refused"})
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.Unavailable || e.Address != "a:1,b:2,c:3" {
		t.Fatalf("none could serve: %#v", err)
	}
	want := "no coordinator can serve query 'q' now (a:1: shard 1 (hf:{s1}:) has no coordinator now; b:2: no answer; c:3: no answer)"
	if !strings.HasPrefix(e.Message, want) {
		t.Fatalf("message %q, want it to start with %q", e.Message, want)
	}

	// One address: its own error, unchanged.
	alone := &Error{Code: codes.Unavailable, Message: "connection refused"}
	if err := NewShardRouter([]string{"a:1"}, 0).route("q").reroute(alone); err != alone {
		t.Fatalf("one address: %v", err)
	}
	// A call not about a query follows no redirect.
	if err := router.route("").reroute(redirect("q", "b:2")); Code(err) != codes.FailedPrecondition {
		t.Fatalf("a redirect of a call not about a query: %v", err)
	}
}

func TestARedirectIsFollowedAndALoopIsAClearError(t *testing.T) {
	router := NewShardRouter([]string{"a:1", "b:2"}, 0)
	rt := router.route("q")
	first := redirect("q", "b:2")
	if ShardOwner(first) != "b:2" || ShardOwner(errors.New("x")) != "" {
		t.Fatalf("ShardOwner: %q", ShardOwner(first))
	}
	if err := rt.reroute(first); err != nil || rt.address != "b:2" || router.Owner("q") != "b:2" {
		t.Fatalf("after a redirect: %v, at %s, owner %q", err, rt.address, router.Owner("q"))
	}
	if next := router.route("q"); next.address != "b:2" {
		t.Fatalf("the next call about q goes to %s, want its owner", next.address)
	}
	err := rt.reroute(redirect("q", "a:1"))
	var loop *ShardRedirectLoopError
	if !errors.As(err, &loop) || !errors.Is(err, ErrShardRedirectLoop) || !errors.Is(err, ErrFailedPrecondition) {
		t.Fatalf("a circle: %#v", err)
	}
	if !reflect.DeepEqual(loop.Hops, []string{"a:1", "b:2", "a:1"}) || loop.QueryID != "q" || Code(err) != codes.FailedPrecondition {
		t.Fatalf("hops %v, query %q, code %v", loop.Hops, loop.QueryID, Code(err))
	}
	want := "hexgenflow: query 'q': the coordinators keep redirecting it (a:1 -> b:2 -> a:1); do they all run with the same --shards? Last answer: query 'q' belongs to shard 1"
	if !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("error %q, want it to start with %q", err.Error(), want)
	}

	// A chain, no circle: it stops after MaxRedirects hops.
	rt = NewShardRouter([]string{"s0"}, 0).route("q")
	for k := 1; ; k++ {
		err := rt.reroute(redirect("q", fmt.Sprintf("s%d", k)))
		if err == nil {
			continue
		}
		if !errors.As(err, &loop) || len(loop.Hops) != MaxRedirects+2 {
			t.Fatalf("a chain: %v", err)
		}
		break
	}
}

func TestDialWithBlockWaitsForAnyAddress(t *testing.T) {
	var dead []string
	for i := 0; i < 2; i++ {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		dead = append(dead, lis.Addr().String())
		lis.Close() // nothing listens there now
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := DialAddresses(ctx, dead, WithBlock())
	var e *Error
	if !errors.As(err, &e) || !errors.Is(err, ErrUnavailable) || e.Address != strings.Join(dead, ",") {
		t.Fatalf("DialAddresses WithBlock, nothing listening: %v, want UNAVAILABLE naming both", err)
	}
}
