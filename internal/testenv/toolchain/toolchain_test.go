package toolchain

import (
	"bytes"
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"time"
)

// The quickstart builds with ClusterOnly: what a cluster runs, and none of
// the servers that only tests start. Every component is one or the other,
// and Missing, which a cluster's start checks, asks only for the first.
func TestClusterOnlyLeavesOutWhatOnlyTestsStart(t *testing.T) {
	var cluster, tests []string
	for _, c := range components() {
		if c.testOnly {
			tests = append(tests, c.name)
		} else {
			cluster = append(cluster, c.name)
		}
	}
	for _, want := range []string{"etcd", "k8s", "containerd", "gvisor"} {
		if !slices.Contains(cluster, want) {
			t.Errorf("%s is not built for a cluster (cluster components: %v)", want, cluster)
		}
	}
	for _, want := range []string{"versitygw", "snapshot-controller", "csi-provisioner", "kube-router"} {
		if !slices.Contains(tests, want) {
			t.Errorf("%s is built for a cluster, though only tests start it (test-only: %v)", want, tests)
		}
	}
	if slices.ContainsFunc(TestPackages, func(p string) bool { return slices.Contains(ClusterPackages, p) }) {
		t.Errorf("a package is both a cluster's and the tests' own: %v, %v", ClusterPackages, TestPackages)
	}

	missing := Missing(t.TempDir())
	for _, m := range missing {
		for _, c := range components() {
			if c.testOnly && slices.ContainsFunc(c.binary, func(b binary) bool { return b.out == m }) {
				t.Errorf("Missing lists %s, which only tests start", m)
			}
		}
	}
	for _, want := range []string{"kube-apiserver", "runsc", LocalPathProvisioner, "images/pause.tar"} {
		if !slices.Contains(missing, want) {
			t.Errorf("Missing on an empty cache does not list %s: %v", want, missing)
		}
	}
}

// A second build waits for the one holding the cache's lock, says so, and
// goes on once it is released; a cancelled wait returns at once.
func TestBuildsOfOneCacheTakeTurns(t *testing.T) {
	dir := t.TempDir()
	var firstOut, secondOut bytes.Buffer
	first := &Builder{Dir: dir, Out: &firstOut}
	unlock, err := first.lockCache(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	second := &Builder{Dir: dir, Out: &secondOut}
	got := make(chan func(), 1)
	go func() {
		u, err := second.lockCache(context.Background())
		if err != nil {
			t.Error(err)
			close(got)
			return
		}
		got <- u
	}()
	select {
	case <-got:
		t.Fatal("the second build took the lock the first holds")
	case <-time.After(700 * time.Millisecond):
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := (&Builder{Dir: dir, Out: io.Discard}).lockCache(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("a cancelled wait: %v, want context.Canceled", err)
	}
	unlock()
	select {
	case u, ok := <-got:
		if ok {
			u()
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the second build did not get the lock once the first released it")
	}
	if !strings.Contains(secondOut.String(), "waiting for it to finish") {
		t.Errorf("the waiting build said %q", secondOut.String())
	}
}

// The restoring shim is the stock shim plus an extension: it must come
// from the very gVisor the stock shim and runsc are built from (a
// checkpoint restores only under the runsc that wrote it), under its own
// cache entry, and its main package must reach the build.
func TestRestoreShimBuildsFromTheStockGVisor(t *testing.T) {
	mod, err := wrappers.ReadFile("wrappers/gvisor-restore-shim/go.mod.txt")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(mod), "gvisor.dev/gvisor "+GVisorVersion+"\n") {
		t.Errorf("the restoring shim's go.mod does not require gVisor %s:\n%s", GVisorVersion, mod)
	}
	stock, err := wrappers.ReadFile("wrappers/gvisor/go.mod.txt")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(stock), "gvisor.dev/gvisor "+GVisorVersion+"\n") {
		t.Errorf("the stock gVisor wrapper does not require %s; GVisorVersion and the wrappers disagree", GVisorVersion)
	}
	srcs, err := wrapperSources("gvisor-restore-shim")
	if err != nil {
		t.Fatal(err)
	}
	main, ok := srcs["main.go"]
	if !ok || !bytes.Contains(main, []byte("extension.NewExtension = ")) || bytes.Contains(main, []byte("go:build")) {
		t.Errorf("main.go of the restoring shim, as written for the build, is missing or keeps its build constraint")
	}
	var restore, stockC component
	for _, c := range components() {
		switch c.name {
		case "gvisor-restore-shim":
			restore = c
		case "gvisor":
			stockC = c
		}
	}
	if !restore.testOnly || len(restore.binary) != 1 || restore.binary[0].out != RestoreShim {
		t.Errorf("restoring shim component: %+v", restore)
	}
	rs, err := restore.stamp()
	if err != nil {
		t.Fatal(err)
	}
	ss, err := stockC.stamp()
	if err != nil {
		t.Fatal(err)
	}
	if rs == ss || slices.Contains(stockC.names(), RestoreShim) {
		t.Errorf("the restoring shim shares the stock shim's cache entry")
	}
	// Components without Go sources keep their stamps.
	if srcs, err := wrapperSources("gvisor"); err != nil || len(srcs) != 0 {
		t.Errorf("the stock gVisor wrapper has Go sources %v (%v)", srcs, err)
	}
}
