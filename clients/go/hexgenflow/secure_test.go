package hexgenflow_test

// Live tests against a secured coordinator (`hexgen-flow up --secure --auth-dir DIR
// --tenants a,b`): TLS only, with a certificate signed by DIR/ca.pem, and an API key on
// every call. They run only when HEXGEN_COORDINATOR_SECURE (its host:port) and
// HEXGEN_COORDINATOR_SECURE_AUTH_DIR (its DIR: ca.pem, tenants/a.key, tenants/b.key) are
// set; scripts/test_clients.py starts such a mesh.

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hexgen-flow/hexgen-flow/clients/go/hexgenflow"
)

type secureMesh struct {
	addr, ca, keyA, keyB string
}

func secured(t *testing.T) secureMesh {
	t.Helper()
	addr := os.Getenv("HEXGEN_COORDINATOR_SECURE")
	dir := os.Getenv("HEXGEN_COORDINATOR_SECURE_AUTH_DIR")
	if addr == "" || dir == "" {
		t.Skip("HEXGEN_COORDINATOR_SECURE and HEXGEN_COORDINATOR_SECURE_AUTH_DIR are not set: no secured coordinator to test against")
	}
	return secureMesh{
		addr: addr,
		ca:   filepath.Join(dir, "ca.pem"),
		keyA: filepath.Join(dir, "tenants", "a.key"),
		keyB: filepath.Join(dir, "tenants", "b.key"),
	}
}

func secureDial(t *testing.T, ctx context.Context, addr string, opts ...hexgenflow.Option) *hexgenflow.Client {
	t.Helper()
	c, err := hexgenflow.Dial(ctx, addr, opts...)
	if err != nil {
		t.Fatalf("Dial(%s): %v", addr, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func wantCode(t *testing.T, what string, err, want error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Errorf("%s: %v, want %v", what, err, want)
	}
}

func TestLiveSecure(t *testing.T) {
	m := secured(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	keyA, err := os.ReadFile(m.keyA)
	if err != nil {
		t.Fatal(err)
	}

	// Tenant a, by the environment's defaults (as the Python client and the CLI read
	// them): a query runs and reads back.
	t.Setenv(hexgenflow.APIKeyEnv, strings.TrimSpace(string(keyA)))
	t.Setenv(hexgenflow.TLSCAEnv, m.ca)
	fromEnv := secureDial(t, ctx, m.addr)
	queryID := id(t, "-a")
	events, err := fromEnv.Run(ctx, hexgenflow.Query{ID: queryID, Workflow: smallWorkflow(), SLOScale: 5})
	if err != nil {
		t.Fatalf("Run as tenant a: %v", err)
	}
	if _, err := events.All(); err != nil {
		t.Fatalf("the events of tenant a's query: %v", err)
	}
	t.Setenv(hexgenflow.APIKeyEnv, "")
	t.Setenv(hexgenflow.TLSCAEnv, "")

	// Tenant a, by options: its query reads back.
	a := secureDial(t, ctx, m.addr, hexgenflow.WithTLSCA(m.ca), hexgenflow.WithAPIKeyFile(m.keyA))
	got, err := a.Get(ctx, queryID)
	if err != nil {
		t.Fatalf("Get as tenant a: %v", err)
	}
	if got.GetQuery().GetQueryId() != queryID || got.GetQuery().GetCallsDone() != 4 {
		t.Errorf("tenant a's query: %v", got.GetQuery())
	}

	// No key: UNAUTHENTICATED.
	anonymous := secureDial(t, ctx, m.addr, hexgenflow.WithTLSCA(m.ca))
	_, err = anonymous.Status(ctx)
	wantCode(t, "ClusterStatus without a key", err, hexgenflow.ErrUnauthenticated)
	_, err = anonymous.Get(ctx, queryID)
	wantCode(t, "GetQuery without a key", err, hexgenflow.ErrUnauthenticated)

	// Tenant b does not see tenant a's query; the same through tenant a's client with
	// b's key for one call.
	b := secureDial(t, ctx, m.addr, hexgenflow.WithTLSCA(m.ca), hexgenflow.WithAPIKeyFile(m.keyB))
	_, err = b.Get(ctx, queryID)
	wantCode(t, "GetQuery of tenant a's query as tenant b", err, hexgenflow.ErrNotFound)
	keyB, err := os.ReadFile(m.keyB)
	if err != nil {
		t.Fatal(err)
	}
	_, err = a.Get(hexgenflow.WithCallAPIKey(ctx, strings.TrimSpace(string(keyB))), queryID)
	wantCode(t, "GetQuery with tenant b's key for the call", err, hexgenflow.ErrNotFound)

	// A tenant may not set alpha.
	_, err = a.SetAlpha(ctx, 0.5, "go client test")
	wantCode(t, "SetAlpha as tenant a", err, hexgenflow.ErrPermissionDenied)

	// Plaintext against the TLS port fails.
	short, shortCancel := context.WithTimeout(ctx, 5*time.Second)
	defer shortCancel()
	plain := secureDial(t, short, m.addr, hexgenflow.WithTLSCA(""), hexgenflow.WithAPIKeyFile(m.keyA))
	if _, err := plain.Status(short); err == nil {
		t.Error("a plaintext ClusterStatus against the TLS port succeeded")
	} else {
		t.Logf("plaintext against the TLS port: %v", err)
	}
}
