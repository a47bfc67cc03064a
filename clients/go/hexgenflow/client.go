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
package hexgenflow

import (
	"context"
	"time"

	pb "github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflowv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
)

// DefaultAddress is where `hexgen-flow up` serves the coordinator by default.
const DefaultAddress = "127.0.0.1:50051"

// Client is a connection to a coordinator; safe for concurrent use.
type Client struct {
	conn *grpc.ClientConn
	rpc  pb.CoordinatorServiceClient
}

// Dial connects to the coordinator at addr ("host:port"). The connection is made in the
// background (unless WithBlock), so an address where nothing listens shows as an
// UNAVAILABLE *Error on the first call.
//
// TLS when given WithTLSCA (or WithTLS, WithTransportCredentials), else when
// $HEXGEN_FLOW_TLS_CA names a CA file; plaintext otherwise. The API key of WithAPIKey or
// WithAPIKeyFile, else $HEXGEN_FLOW_API_KEY, goes with every call as
// "authorization: Bearer <key>". An unreadable CA or key file is Dial's error.
func Dial(ctx context.Context, addr string, opts ...Option) (*Client, error) {
	o := &options{maxRecv: DefaultMaxRecvBytes}
	for _, opt := range opts {
		opt(o)
	}
	if err := o.resolve(); err != nil {
		return nil, err
	}
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
	if o.block {
		dialOpts = append(dialOpts, grpc.WithBlock())
	}
	dialOpts = append(dialOpts, o.dialOpts...)
	conn, err := grpc.DialContext(ctx, addr, dialOpts...)
	if err != nil {
		e := wrap(ctx, err, nil).(*Error)
		if o.block && (e.Code == codes.DeadlineExceeded || e.Code == codes.Canceled) {
			e.Code = codes.Unavailable
			e.Message = "no coordinator answered at " + addr + ": " + e.Message
			e.status = nil
		}
		return nil, e
	}
	return &Client{conn: conn, rpc: pb.NewCoordinatorServiceClient(conn)}, nil
}

// Close closes the connection; streams still open end with a CANCELED error.
func (c *Client) Close() error { return c.conn.Close() }

// Conn is the underlying connection (for other services or a health check).
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// Stub is the generated client, for what this package does not wrap. Calls through it
// still carry the client's headers and the context's traceparent.
func (c *Client) Stub() pb.CoordinatorServiceClient { return c.rpc }

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
	var trailer metadata.MD
	resp, err := c.rpc.SubmitQuery(ctx, q.request(), grpc.Trailer(&trailer))
	return resp, wrap(ctx, err, trailer)
}

// Watch follows a query's events (WatchQuery): the past ones first, then live, until the
// terminal one (SUCCEEDED, CANCELLED or FAILED), after which Next returns io.EOF. An
// unknown id is a NOT_FOUND error from Watch itself.
func (c *Client) Watch(parent context.Context, queryID string) (*Events, error) {
	ctx, cancel := context.WithCancel(parent)
	stream, err := c.rpc.WatchQuery(ctx, &pb.WatchQueryRequest{QueryId: queryID})
	if err != nil {
		cancel()
		return nil, wrap(ctx, err, nil)
	}
	recv := func() (*pb.QueryEvent, error) {
		r, err := stream.Recv()
		return r.GetEvent(), err
	}
	return newEvents(parent, ctx, cancel, recv, stream.Trailer, isQueryEnd)
}

// Run submits a query and follows its events (RunQuery): Submit then Watch in one call.
// A refused submission is the error of Run itself.
func (c *Client) Run(parent context.Context, q Query) (*Events, error) {
	ctx, cancel := context.WithCancel(parent)
	stream, err := c.rpc.RunQuery(ctx, &pb.RunQueryRequest{Query: q.request()})
	if err != nil {
		cancel()
		return nil, wrap(ctx, err, nil)
	}
	recv := func() (*pb.QueryEvent, error) {
		r, err := stream.Recv()
		return r.GetEvent(), err
	}
	return newEvents(parent, ctx, cancel, recv, stream.Trailer, isQueryEnd)
}

// Cancel cancels a query (CancelQuery): its waiting calls are dropped, running ones
// aborted. It returns the query's state after the cancel.
func (c *Client) Cancel(ctx context.Context, queryID string) (*pb.QueryInfo, error) {
	resp, err := c.rpc.CancelQuery(ctx, &pb.CancelQueryRequest{QueryId: queryID})
	if err != nil {
		return nil, wrap(ctx, err, nil)
	}
	return resp.GetQuery(), nil
}

// Get reads a query: its state, its event log and its stages (GetQuery).
func (c *Client) Get(ctx context.Context, queryID string) (*pb.GetQueryResponse, error) {
	resp, err := c.rpc.GetQuery(ctx, &pb.GetQueryRequest{QueryId: queryID})
	return resp, wrap(ctx, err, nil)
}

// Status reads the cluster: instances and their load, the policy, alpha, the clock
// (ClusterStatus).
func (c *Client) Status(ctx context.Context) (*pb.ClusterStatusResponse, error) {
	resp, err := c.rpc.ClusterStatus(ctx, &pb.ClusterStatusRequest{})
	return resp, wrap(ctx, err, nil)
}

// SetAlpha sets the dispatcher's alpha (what the tuner does); reason is kept in the
// alpha history. It returns the alpha before.
func (c *Client) SetAlpha(ctx context.Context, alpha float64, reason string) (float64, error) {
	resp, err := c.rpc.SetAlpha(ctx, &pb.SetAlphaRequest{Alpha: alpha, Reason: reason})
	if err != nil {
		return 0, wrap(ctx, err, nil)
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
