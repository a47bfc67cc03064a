// Package hexgenflow is a Go client of the HexGen-Flow coordinator
// (protos/hexgen_flow/v1/coordinator.proto): submit workflows and follow their events,
// run workflow sessions whose calls are given one at a time, and read the cluster's state.
//
//	c, err := hexgenflow.Dial(ctx, "127.0.0.1:50051")
//	if err != nil { ... }
//	defer c.Close()
//	events, err := c.Run(ctx, hexgenflow.Query{ID: "q-1", Workflow: wf})
//	if err != nil { ... }
//	defer events.Close()
//	for {
//		ev, err := events.Next()
//		if err == io.EOF {
//			break // after the terminal event (SUCCEEDED, CANCELLED or FAILED)
//		}
//		if err != nil { ... }
//		fmt.Println(ev.Kind, ev.TimeS)
//	}
//
// Every error the coordinator answers is an *Error (its gRPC code, message and, for a
// refusal, the retry-after hint); match kinds with errors.Is(err, hexgenflow.ErrNotFound)
// and the other sentinels. The generated messages and stubs are in package hexgenflowv1.
//
// A sharded mesh's coordinators are given together, Dial(ctx, "host:port,host:port") or
// DialAddresses(ctx, []string{...}): every call about a query goes where a ShardRouter
// says (the owner learnt from an earlier redirect, else the default address), follows
// redirects and moves on past coordinators that do not answer (routing.go).
package hexgenflow

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"time"

	pb "github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflowv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// DefaultAddress is where `hexgen-flow up` serves the coordinator by default.
const DefaultAddress = "127.0.0.1:50051"

// Client is a connection to a coordinator, or to a sharded mesh's coordinators (one
// connection per address used); safe for concurrent use.
type Client struct {
	opts   *options
	router *ShardRouter
	first  *grpc.ClientConn // the first address's, dialled by Dial

	mu     sync.Mutex
	conns  map[string]*grpc.ClientConn
	closed bool
}

// Dial connects to the coordinator at addr ("host:port"), or to a sharded mesh's
// coordinators given as a comma list ("host:port,host:port"; DialAddresses takes a
// slice). The connection is made in the background (unless WithBlock), so an address where
// nothing listens shows as an UNAVAILABLE *Error on the first call.
//
// With several coordinators (each owning the workflows whose id hashes to its shard) every
// call about a query goes to the coordinator last learnt to own it, else to the first
// address; a coordinator's redirect (FAILED_PRECONDITION naming the owner in the
// ShardOwnerTrailer) is followed and remembered (Router), a circle of redirects is a
// *ShardRedirectLoopError, and an address that does not answer (or whose shard is being
// taken over) is passed for the next one. The addresses other than the first are dialled
// when first used, as is an owner a redirect names that was not given.
//
// TLS when given WithTLSCA (or WithTLS, WithTransportCredentials), else when
// $HEXGEN_FLOW_TLS_CA names a CA file; plaintext otherwise. The API key of WithAPIKey or
// WithAPIKeyFile, else $HEXGEN_FLOW_API_KEY, goes with every call as
// "authorization: Bearer <key>". An unreadable CA or key file is Dial's error.
func Dial(ctx context.Context, addr string, opts ...Option) (*Client, error) {
	return DialAddresses(ctx, []string{addr}, opts...)
}

// DialAddresses is Dial for the coordinators of a sharded mesh given as a slice (each
// element an address or a comma list), tried in that order when one does not answer. With
// WithBlock it waits until one of them is connected, and the first of those is the
// default address.
func DialAddresses(ctx context.Context, addrs []string, opts ...Option) (*Client, error) {
	addresses, err := SplitAddresses(addrs...)
	if err != nil {
		return nil, err
	}
	o := &options{maxRecv: DefaultMaxRecvBytes}
	for _, opt := range opts {
		opt(o)
	}
	if err := o.resolve(); err != nil {
		return nil, err
	}
	c := &Client{opts: o, router: NewShardRouter(addresses, 0), conns: map[string]*grpc.ClientConn{}}
	if len(addresses) == 1 || !o.block {
		if c.first, err = c.dial(ctx, addresses[0], o.block); err != nil {
			return nil, err
		}
		return c, nil
	}
	return c, c.waitAny(ctx, addresses)
}

// waitAny dials every address and waits until one is connected (WithBlock with several).
func (c *Client) waitAny(ctx context.Context, addresses []string) error {
	conns := make([]*grpc.ClientConn, len(addresses))
	for i, addr := range addresses {
		conn, err := c.dial(ctx, addr, false)
		if err != nil {
			_ = c.Close()
			return err
		}
		conns[i] = conn
	}
	c.first = conns[0]
	for {
		for i, conn := range conns {
			if conn.GetState() == connectivity.Ready {
				for _, before := range addresses[:i] {
					c.router.WentAway(before)
				}
				return nil
			}
		}
		select {
		case <-ctx.Done():
			_ = c.Close()
			return &Error{
				Code: codes.Unavailable, Address: strings.Join(addresses, ","), cause: ctx.Err(),
				Message: "no coordinator answered at " + strings.Join(addresses, ",") + ": " + ctx.Err().Error(),
			}
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// dial opens the connection to addr and keeps it (blocking until it is up with block).
func (c *Client) dial(ctx context.Context, addr string, block bool) (*grpc.ClientConn, error) {
	o := c.opts
	dialOpts := []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(o.unaryInterceptor),
		grpc.WithChainStreamInterceptor(o.streamInterceptor),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(o.maxRecv)),
	}
	if o.creds != nil {
		dialOpts = append(dialOpts, grpc.WithTransportCredentials(o.creds))
	} else {
		dialOpts = append(dialOpts, grpc.WithInsecure())
	}
	if block {
		dialOpts = append(dialOpts, grpc.WithBlock())
	}
	dialOpts = append(dialOpts, o.dialOpts...)
	conn, err := grpc.DialContext(ctx, addr, dialOpts...)
	if err != nil {
		e := wrap(ctx, err, nil).(*Error)
		if block && (e.Code == codes.DeadlineExceeded || e.Code == codes.Canceled) {
			e.Code = codes.Unavailable
			e.Message = "no coordinator answered at " + addr + ": " + e.Message
			e.status = nil
		}
		e.Address = addr
		return nil, e
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		_ = conn.Close()
		return nil, errClosed(addr)
	}
	c.conns[addr] = conn
	return conn, nil
}

func errClosed(addr string) *Error {
	return &Error{Code: codes.Canceled, Message: "the client is closed", Address: addr}
}

// connAt is the connection to addr, dialled now (in the background) if it was not yet.
func (c *Client) connAt(addr string) (*grpc.ClientConn, error) {
	c.mu.Lock()
	conn, ok := c.conns[addr]
	closed := c.closed
	c.mu.Unlock()
	if closed {
		return nil, errClosed(addr)
	}
	if ok {
		return conn, nil
	}
	conn, err := c.dial(context.Background(), addr, false)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if kept := c.conns[addr]; kept != conn { // another call dialled it meanwhile
		_ = conn.Close()
		if kept == nil {
			return nil, errClosed(addr)
		}
		return kept, nil
	}
	return conn, nil
}

// Close closes the connections; streams still open end with a CANCELED error.
func (c *Client) Close() error {
	c.mu.Lock()
	conns := c.conns
	c.conns, c.closed = map[string]*grpc.ClientConn{}, true
	c.mu.Unlock()
	var first error
	for _, conn := range conns {
		if err := conn.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// Conn is the connection to the default coordinator (for other services or a health
// check).
func (c *Client) Conn() *grpc.ClientConn {
	if conn, err := c.connAt(c.router.Default()); err == nil {
		return conn
	}
	return c.first
}

// Stub is the generated client of the default coordinator, for what this package does not
// wrap: its calls are not routed (ShardOwner reads a redirect's owner). They still carry
// the client's headers and the context's traceparent.
func (c *Client) Stub() pb.CoordinatorServiceClient { return pb.NewCoordinatorServiceClient(c.Conn()) }

// Addresses are the coordinators the client was given, in the order they are tried.
func (c *Client) Addresses() []string { return c.router.Addresses() }

// Router is where each query's calls go: the owners learnt from redirects, the default
// address.
func (c *Client) Router() *ShardRouter { return c.router }

// unary sends call where the router says for queryID ("": the default coordinator), again
// after each redirect or unanswered address, until one answers.
func (c *Client) unary(ctx context.Context, queryID string, call func(pb.CoordinatorServiceClient, ...grpc.CallOption) error) error {
	rt := c.router.route(queryID)
	for {
		address := rt.address
		conn, err := c.connAt(address)
		if err == nil {
			var trailer metadata.MD
			if err = call(pb.NewCoordinatorServiceClient(conn), grpc.Trailer(&trailer)); err == nil {
				return nil
			}
			err = wrap(ctx, err, trailer)
		}
		if err = c.reroute(ctx, rt, err, address); err != nil {
			return err
		}
	}
}

// reroute: nil when the call is to be sent again, to rt.address (after a redirect or an
// address that could not serve); else the error to return.
func (c *Client) reroute(ctx context.Context, rt *route, err error, address string) error {
	var e *Error
	if !errors.As(err, &e) {
		return err
	}
	e.Address = address
	if e.Code == codes.Unavailable {
		e.answered = strings.HasPrefix(e.Message, "redis unavailable") || c.connected(address)
	}
	if ctx.Err() != nil {
		return err
	}
	return rt.reroute(e)
}

// connected reports whether the connection to address is up (so an UNAVAILABLE that came
// through it was the coordinator's own answer).
func (c *Client) connected(address string) bool {
	c.mu.Lock()
	conn := c.conns[address]
	c.mu.Unlock()
	return conn != nil && conn.GetState() == connectivity.Ready
}

// opener opens a stream on rpc with ctx: its receive function, its trailer.
type opener func(ctx context.Context, rpc pb.CoordinatorServiceClient) (func() (*pb.QueryEvent, error), func() metadata.MD, error)

// events opens a stream where the router says for queryID, routed as unary: a redirect (or
// an unanswered address) is the error of its first receive, before any event, and the
// stream is opened again where the route goes next. An error once events came is the
// stream's, as it is (opening it again would repeat them); when its coordinator went away
// (UNAVAILABLE), the router stops preferring it, so that a re-watch finds the shard's
// successor.
func (c *Client) events(parent context.Context, queryID string, open opener, isEnd func(*pb.QueryEvent) bool) (*Events, error) {
	rt := c.router.route(queryID)
	for {
		address := rt.address
		conn, err := c.connAt(address)
		if err == nil {
			var events *Events
			if events, err = c.openAt(parent, address, conn, open, isEnd); err == nil {
				return events, nil
			}
		}
		if err = c.reroute(parent, rt, err, address); err != nil {
			return nil, err
		}
	}
}

func (c *Client) openAt(
	parent context.Context, address string, conn *grpc.ClientConn, open opener, isEnd func(*pb.QueryEvent) bool,
) (*Events, error) {
	ctx, cancel := context.WithCancel(parent)
	recv, trailer, err := open(ctx, pb.NewCoordinatorServiceClient(conn))
	if err != nil {
		cancel()
		return nil, wrap(ctx, err, nil)
	}
	started := false
	routed := func() (*pb.QueryEvent, error) {
		ev, err := recv()
		if err == nil {
			started = true
		} else if started && err != io.EOF && ctx.Err() == nil {
			if code := status.Code(err); code == codes.Unavailable || code == codes.Canceled {
				c.router.WentAway(address) // it served this stream and broke it
			}
		}
		return ev, err
	}
	return newEvents(parent, ctx, cancel, routed, trailer, isEnd)
}

// Query is a workflow to submit: SubmitQuery's request.
type Query struct {
	// ID is chosen by the client and is the idempotency key: submitting it again with the
	// same content returns the stored query (created false), with other content is
	// ALREADY_EXISTS.
	ID string
	// Tenant; empty means "default".
	Tenant string
	// Workflow is the DAG of stages and their calls.
	Workflow *pb.Workflow
	// SLOSeconds is the end-to-end SLO on the cluster clock; 0 means SLOScale x SLO_base.
	SLOSeconds float64
	// SLOScale is a multiple of SLO_base; 0 means the coordinator's default scale.
	SLOScale float64
}

func (q Query) request() *pb.SubmitQueryRequest {
	return &pb.SubmitQueryRequest{
		QueryId: q.ID, Tenant: q.Tenant, Workflow: q.Workflow,
		SloS: q.SLOSeconds, SloScale: q.SLOScale,
	}
}

// Submit admits a query (SubmitQuery). The response's Created is false when the id was
// known already. Refusals: INVALID_ARGUMENT naming the field, ALREADY_EXISTS,
// RESOURCE_EXHAUSTED with a retry-after hint.
func (c *Client) Submit(ctx context.Context, q Query) (*pb.SubmitQueryResponse, error) {
	var resp *pb.SubmitQueryResponse
	err := c.unary(ctx, q.ID, func(rpc pb.CoordinatorServiceClient, opts ...grpc.CallOption) (err error) {
		resp, err = rpc.SubmitQuery(ctx, q.request(), opts...)
		return err
	})
	return resp, err
}

// Watch follows a query's events (WatchQuery): the past ones first, then live, until the
// terminal one (SUCCEEDED, CANCELLED or FAILED), after which Next returns io.EOF. An
// unknown id is a NOT_FOUND error from Watch itself.
func (c *Client) Watch(parent context.Context, queryID string) (*Events, error) {
	open := func(ctx context.Context, rpc pb.CoordinatorServiceClient) (func() (*pb.QueryEvent, error), func() metadata.MD, error) {
		stream, err := rpc.WatchQuery(ctx, &pb.WatchQueryRequest{QueryId: queryID})
		if err != nil {
			return nil, nil, err
		}
		recv := func() (*pb.QueryEvent, error) {
			r, err := stream.Recv()
			return r.GetEvent(), err
		}
		return recv, stream.Trailer, nil
	}
	return c.events(parent, queryID, open, isQueryEnd)
}

// Run submits a query and follows its events (RunQuery): Submit then Watch in one call.
// A refused submission is the error of Run itself.
func (c *Client) Run(parent context.Context, q Query) (*Events, error) {
	open := func(ctx context.Context, rpc pb.CoordinatorServiceClient) (func() (*pb.QueryEvent, error), func() metadata.MD, error) {
		stream, err := rpc.RunQuery(ctx, &pb.RunQueryRequest{Query: q.request()})
		if err != nil {
			return nil, nil, err
		}
		recv := func() (*pb.QueryEvent, error) {
			r, err := stream.Recv()
			return r.GetEvent(), err
		}
		return recv, stream.Trailer, nil
	}
	return c.events(parent, q.ID, open, isQueryEnd)
}

// Cancel cancels a query (CancelQuery): its waiting calls are dropped, running ones
// aborted. It returns the query's state after the cancel.
func (c *Client) Cancel(ctx context.Context, queryID string) (*pb.QueryInfo, error) {
	var resp *pb.CancelQueryResponse
	err := c.unary(ctx, queryID, func(rpc pb.CoordinatorServiceClient, opts ...grpc.CallOption) (err error) {
		resp, err = rpc.CancelQuery(ctx, &pb.CancelQueryRequest{QueryId: queryID}, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp.GetQuery(), nil
}

// Get reads a query: its state, its event log and its stages (GetQuery).
func (c *Client) Get(ctx context.Context, queryID string) (*pb.GetQueryResponse, error) {
	var resp *pb.GetQueryResponse
	err := c.unary(ctx, queryID, func(rpc pb.CoordinatorServiceClient, opts ...grpc.CallOption) (err error) {
		resp, err = rpc.GetQuery(ctx, &pb.GetQueryRequest{QueryId: queryID}, opts...)
		return err
	})
	return resp, err
}

// Status reads the cluster: instances and their load, the policy, alpha, the clock
// (ClusterStatus). With shards, of the default coordinator (the next one when it does not
// answer: every coordinator sees every instance).
func (c *Client) Status(ctx context.Context) (*pb.ClusterStatusResponse, error) {
	var resp *pb.ClusterStatusResponse
	err := c.unary(ctx, "", func(rpc pb.CoordinatorServiceClient, opts ...grpc.CallOption) (err error) {
		resp, err = rpc.ClusterStatus(ctx, &pb.ClusterStatusRequest{}, opts...)
		return err
	})
	return resp, err
}

// SetAlpha sets the dispatcher's alpha (what the tuner does); reason is kept in the
// alpha history. It returns the alpha before. With shards, at the default coordinator
// (the next one when it does not answer).
func (c *Client) SetAlpha(ctx context.Context, alpha float64, reason string) (float64, error) {
	var resp *pb.SetAlphaResponse
	err := c.unary(ctx, "", func(rpc pb.CoordinatorServiceClient, opts ...grpc.CallOption) (err error) {
		resp, err = rpc.SetAlpha(ctx, &pb.SetAlphaRequest{Alpha: alpha, Reason: reason}, opts...)
		return err
	})
	if err != nil {
		return 0, err
	}
	return resp.GetPreviousAlpha(), nil
}

// WaitReady calls ClusterStatus until it answers and every instance has a connected
// worker, or ctx ends (then the last error, or UNAVAILABLE).
func (c *Client) WaitReady(ctx context.Context) (*pb.ClusterStatusResponse, error) {
	var last error
	for {
		st, err := c.Status(ctx)
		if err == nil {
			ready := len(st.GetInstances()) > 0
			for _, inst := range st.GetInstances() {
				ready = ready && inst.GetConnected()
			}
			if ready {
				return st, nil
			}
		} else {
			last = err
		}
		select {
		case <-ctx.Done():
			if last == nil {
				last = &Error{Code: codes.Unavailable, Message: "workers not all connected", cause: ctx.Err()}
			}
			return nil, last
		case <-time.After(100 * time.Millisecond):
		}
	}
}
