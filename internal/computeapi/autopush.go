package computeapi

import (
	"context"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/api/meta"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
)

// The platform pushes the workspace into the agent's filespace after each tool
// call. A push walks the workspace, so it is not run inside the call (a
// command's answer would wait for it) nor once per call of a burst: the
// calls that can change the workspace schedule one push per agent, run
// DefaultFilespacePushDelay after the last of them. The idle stop pushes
// too, so a push lost to a restart of the control plane is made up then.

// DefaultFilespacePushDelay is how long after an agent's last call that can
// change its workspace the workspace is pushed.
const DefaultFilespacePushDelay = 2 * time.Second

// pushAfter are the operations after which the workspace may have changed.
var pushAfter = map[string]bool{
	"run_command": true, "run_command_stream": true, "run_command_pty": true, "put_file": true, "delete_file": true,
	"tool_request": true, "execute": true, "mcp_request": true,
}

type autoPusher struct {
	s     *Server
	delay time.Duration
	log   logr.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	timers map[string]*time.Timer
}

func newAutoPusher(s *Server, delay time.Duration) *autoPusher {
	ctx, cancel := context.WithCancel(context.Background())
	return &autoPusher{s: s, delay: delay, log: s.log.WithName("filespace"), ctx: ctx, cancel: cancel, timers: map[string]*time.Timer{}}
}

// touch (re)schedules the push of agentID's workspace.
func (p *autoPusher) touch(agentID string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ctx.Err() != nil {
		return
	}
	if t, ok := p.timers[agentID]; ok && t.Stop() {
		t.Reset(p.delay)
		return
	}
	// A timer that already fired is pushing now; the new one follows it
	// (pushes of one agent take turns in filespace.Sync).
	p.wg.Add(1)
	var t *time.Timer
	t = time.AfterFunc(p.delay, func() {
		defer p.wg.Done()
		p.mu.Lock()
		if p.timers[agentID] == t {
			delete(p.timers, agentID)
		}
		p.mu.Unlock()
		p.push(agentID)
	})
	p.timers[agentID] = t
}

// push syncs a running sandbox's workspace into its filespace. A sandbox
// that stopped meanwhile is left alone: its stop pushed, and a push must
// never wake it.
func (p *autoPusher) push(agentID string) {
	ctx, cancel := context.WithTimeout(p.ctx, filespace.Timeout)
	defer cancel()
	log := p.log.WithValues("agent", agentID)
	sb, apiErr := p.s.agentSandbox(ctx, agentID)
	if apiErr != nil || sb.Status.ServiceEndpoint == "" || !meta.IsStatusConditionTrue(sb.Status.Conditions, v1alpha1.ConditionReady) {
		return
	}
	sup, err := p.s.conns.For(sb)
	if err != nil {
		log.Error(err, "dial the supervisor to push the workspace")
		return
	}
	start := p.s.clock.Now()
	sum, err := filespace.Sync(ctx, sup, p.s.store, filespace.Options{
		// The supervisor's cap, as for sync_filespace.
		AgentID: agentID, Direction: filespace.Push, Now: p.s.clock.Now,
	})
	if err != nil {
		// Not an error of anyone's call; the next push or the idle stop
		// tries again.
		log.Info("pushing the workspace into the filespace after a call failed", "error", err.Error())
		return
	}
	if sum.Pushed+sum.Deleted > 0 {
		log.V(1).Info("workspace pushed", "pushed", sum.Pushed, "deleted", sum.Deleted, "bytes", sum.Bytes,
			"duration_ms", p.s.clock.Since(start).Milliseconds())
	}
}

// close cancels pushes in flight and waits for them, dropping those not
// yet due.
func (p *autoPusher) close() {
	p.mu.Lock()
	p.cancel()
	for id, t := range p.timers {
		if t.Stop() {
			p.wg.Done()
		}
		delete(p.timers, id)
	}
	p.mu.Unlock()
	p.wg.Wait()
}
