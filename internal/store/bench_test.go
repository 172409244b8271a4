package store_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// BenchmarkAuditAppend measures one audited call's cost in the store: a
// write transaction that locks the chain head, inserts and advances it.
func BenchmarkAuditAppend(b *testing.B) {
	for _, be := range backends {
		b.Run(be.name, func(b *testing.B) {
			s := open(b, be.newDSN(b), store.Options{})
			ctx := context.Background()
			e := store.AuditEntry{Caller: "token-1", CallerKind: "agent", AgentID: "agent-1", Operation: "run_command",
				ParamsHash: hexHash("params"), Duration: 3 * time.Millisecond, Result: "ok", Status: 200, RequestID: "req-1"}
			for b.Loop() {
				if _, err := s.AppendAudit(ctx, e); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkAuditAppendParallel measures appends under contention: every
// goroutine queues for the same chain head.
func BenchmarkAuditAppendParallel(b *testing.B) {
	for _, be := range backends {
		b.Run(be.name, func(b *testing.B) {
			s := open(b, be.newDSN(b), store.Options{})
			ctx := context.Background()
			e := store.AuditEntry{Caller: "token-1", AgentID: "agent-1", Operation: "run_command", Result: "ok", Status: 200}
			b.SetParallelism(4)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := s.AppendAudit(ctx, e); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// BenchmarkTokenLookup measures authenticating a request: one indexed read
// by hash among 1000 tokens.
func BenchmarkTokenLookup(b *testing.B) {
	for _, be := range backends {
		b.Run(be.name, func(b *testing.B) {
			s := open(b, be.newDSN(b), store.Options{})
			ctx := context.Background()
			const n = 1000
			hashes := make([]store.TokenHash, n)
			for i := range hashes {
				hashes[i] = hashOf(fmt.Sprint("token-", i))
				if _, err := s.CreateToken(ctx, store.Token{Hash: hashes[i], Kind: store.TokenAgent, AgentID: fmt.Sprint("agent-", i)}); err != nil {
					b.Fatal(err)
				}
			}
			i := 0
			for b.Loop() {
				if _, err := s.LookupToken(ctx, hashes[i%n]); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}

// BenchmarkAuditAppendBatch32 measures appending 32 buffered entries in one
// transaction; ns/op is per batch, record/s the throughput.
func BenchmarkAuditAppendBatch32(b *testing.B) {
	for _, be := range backends {
		b.Run(be.name, func(b *testing.B) {
			s := open(b, be.newDSN(b), store.Options{})
			ctx := context.Background()
			batch := make([]store.AuditEntry, 32)
			for i := range batch {
				batch[i] = store.AuditEntry{Caller: "token-1", AgentID: "agent-1", Operation: "run_command",
					ParamsHash: hexHash(fmt.Sprint(i)), Result: "ok", Status: 200}
			}
			start := time.Now()
			for b.Loop() {
				if _, err := s.AppendAuditBatch(ctx, batch); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*len(batch))/time.Since(start).Seconds(), "records/s")
		})
	}
}

// BenchmarkTakeWarm measures the decision of a warm-pool claim: one row
// insert, with the claims of a burst contending for the writer.
func BenchmarkTakeWarm(b *testing.B) {
	for _, be := range backends {
		b.Run(be.name, func(b *testing.B) {
			s := open(b, be.newDSN(b), store.Options{})
			ctx := context.Background()
			var n atomic.Int64
			b.SetParallelism(4)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					i := n.Add(1)
					t := store.WarmTake{SandboxUID: fmt.Sprint("uid-", i), Namespace: "ns", Pool: "p", Sandbox: fmt.Sprint("w-", i),
						Taker: store.WarmTakenByLease, Holder: "bench", RequestID: fmt.Sprint("req-", i), LeaseID: "l", TTLSeconds: 60}
					if _, ok, err := s.TakeWarm(ctx, t); err != nil || !ok {
						b.Errorf("take %d: %v, %v", i, ok, err)
						return
					}
				}
			})
		})
	}
}
