#!/bin/bash
# suspendspike.sh: exploration of checkpointing and restoring a gVisor pod's
# sandbox on the test cluster (see docs/notes/suspend-with-memory.md). Run
# it through cluster-test, as root:
#   .build/bin/agentbox-testenv exec -node -- bash hack/suspendspike.sh
# It prints what every step did; nothing asserts.
set -u
export KUBECONFIG=${KUBECONFIG:-${AGENTBOX_TEST_KUBECONFIG:-}}
TE=${AGENTBOX_TESTENV_DIR:-$HOME/.cache/agentbox/testenv/v1}
RUN=$TE/run
BIN=$TE/bin
OUT=${SPIKE_OUT:-/tmp/suspendspike}
FILL_MIB=${SPIKE_FILL_MIB:-1024}
NS=suspendspike
NETNS=abx-suspendspike
# The runsc shim keeps its runsc state under root/<containerd namespace>.
RUNSC_CLUSTER="$BIN/runsc --root $RUN/runsc/k8s.io --platform=systrap"
RROOT=$OUT/runsc-root
RUNSC_SPIKE="$BIN/runsc --root $RROOT --platform=systrap"
CTR="$BIN/ctr -a $RUN/containerd/containerd.sock -n k8s.io"
PYIMG=docker.io/agentbox-test/debian-python:${AGENTBOX_TEST_IMAGE_TAG:-dev}

now() { date +%s.%N; }
since() { python3 -c "import sys; print('%.3fs' % (float(sys.argv[2]) - float(sys.argv[1])))" "$1" "$(now)"; }
step() { echo; echo "=== $* ($(date -u +%T))"; }

cleanup() {
	step cleanup
	for id in spike-python spike-counter spike-pause; do
		$RUNSC_SPIKE kill "$id" KILL >/dev/null 2>&1
		$RUNSC_SPIKE delete --force "$id" >/dev/null 2>&1
	done
	for m in $(grep " $OUT/" /proc/self/mounts | awk '{print $2}' | sort -r); do umount -l "$m"; done
	ip netns del $NETNS 2>/dev/null
	kubectl delete ns $NS --wait=false >/dev/null 2>&1
	rm -rf "$OUT"/ck-* "$OUT"/b-*
}
trap cleanup EXIT

rm -rf "$OUT"; mkdir -p "$OUT" "$RROOT"
step versions
$BIN/runsc --version | head -2
$BIN/containerd --version
kubectl version 2>/dev/null | tail -1
command -v criu || echo "criu: not installed"

step pod with a counter and a python REPL on a FIFO
kubectl create ns $NS
cat <<EOF | kubectl apply -f -
apiVersion: v1
kind: Pod
metadata: {name: spike, namespace: $NS}
spec:
  runtimeClassName: gvisor
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: 1
  containers:
  - name: counter
    image: agentbox.test/busybox:test
    imagePullPolicy: Never
    command: [sh, -c, 'i=0; while :; do echo \$i > /tmp/count; i=\$((i+1)); sleep 0.1; done']
  - name: python
    image: $PYIMG
    imagePullPolicy: Never
    command:
    - python3
    - -u
    - -c
    - |
      import code, os, sys
      os.mkfifo('/tmp/in')
      sys.stdout = sys.stderr = open('/tmp/out', 'a', buffering=1)
      print('repl ready', flush=True)
      interp = code.InteractiveInterpreter()
      while True:
          with open('/tmp/in') as f:
              for line in f:
                  interp.runsource(line)
EOF
kubectl -n $NS wait --for=condition=Ready pod/spike --timeout=120s || { kubectl -n $NS describe pod spike; exit 1; }
repl() { # repl CONTAINER-EXEC... -- LINE: sends LINE to the REPL, prints its output file
	kubectl -n $NS exec spike -c python -- sh -c "echo '$1' > /tmp/in; sleep 0.3; tail -n 3 /tmp/out"
}
repl 'x = 41 + 1'
repl 'print("x is", x)'
sleep 1
kubectl -n $NS exec spike -c counter -- cat /tmp/count

CID_COUNTER=$(kubectl -n $NS get pod spike -o jsonpath='{.status.containerStatuses[?(@.name=="counter")].containerID}' | sed 's|.*://||')
CID_PYTHON=$(kubectl -n $NS get pod spike -o jsonpath='{.status.containerStatuses[?(@.name=="python")].containerID}' | sed 's|.*://||')
SB=$($CTR containers info "$CID_COUNTER" | jq -r '.Spec.annotations["io.kubernetes.cri.sandbox-id"]')
echo "sandbox $SB counter $CID_COUNTER python $CID_PYTHON"
$RUNSC_CLUSTER list

step "Q1a: kubelet checkpoint API (POST /checkpoint/ns/pod/container through the apiserver's node proxy)"
t=$(now)
kubectl create --raw "/api/v1/nodes/agentbox-node-0/proxy/checkpoint/$NS/spike/counter" -f /dev/null 2>&1 | head -5
echo "took $(since "$t")"
grep -i checkpoint $RUN/containerd.log | tail -5
grep -i checkpoint $RUN/kubelet.log | tail -3

step "Q1b: containerd task checkpoint (ctr tasks checkpoint, the call CRI makes)"
t=$(now)
$CTR tasks checkpoint "$CID_COUNTER" 2>&1 | head -5
echo "took $(since "$t")"

step "Q2a: runsc checkpoint --leave-running on the pod sandbox (idle)"
t=$(now)
$RUNSC_CLUSTER checkpoint --image-path "$OUT/ck-idle" --leave-running "$SB" 2>&1 | tail -5; rc=${PIPESTATUS[0]}
echo "rc=$rc took $(since "$t")"
ls -la "$OUT/ck-idle"; du -sh "$OUT/ck-idle"
kubectl -n $NS get pod spike -o wide
kubectl -n $NS exec spike -c counter -- cat /tmp/count
sleep 1
kubectl -n $NS exec spike -c counter -- cat /tmp/count
repl 'print("x after checkpoint", x)'

step "Q2b: compressed vs not: runsc checkpoint --compression=none --leave-running"
t=$(now)
$RUNSC_CLUSTER checkpoint --image-path "$OUT/ck-idle-raw" --compression=none --leave-running "$SB" 2>&1 | tail -5; rc=${PIPESTATUS[0]}
echo "rc=$rc took $(since "$t")"
du -sh "$OUT/ck-idle-raw"

step "Q4: fill ${FILL_MIB} MiB of random bytes in the REPL, checkpoint again"
repl 'import os'
t=$(now)
repl "blob = os.urandom($FILL_MIB << 20)"
echo "fill took $(since "$t")"
sleep 2
repl 'print("blob", len(blob))'
t=$(now)
$RUNSC_CLUSTER checkpoint --image-path "$OUT/ck-fill" --leave-running "$SB" 2>&1 | tail -5; rc=${PIPESTATUS[0]}
echo "rc=$rc took $(since "$t") (default compression)"
du -sh "$OUT/ck-fill"
t=$(now)
$RUNSC_CLUSTER checkpoint --image-path "$OUT/ck-fill-raw" --compression=none --leave-running "$SB" 2>&1 | tail -5; rc=${PIPESTATUS[0]}
echo "rc=$rc took $(since "$t") (--compression=none)"
du -sh "$OUT/ck-fill-raw"
repl 'del blob; print("blob freed")'

step "Q3 prep: copy the bundles and pin the rootfs and mount sources, so that a restore outside containerd finds them"
BUNDLES=$RUN/containerd/state/io.containerd.runtime.v2.task/k8s.io
i=0
for pair in pause:$SB counter:$CID_COUNTER python:$CID_PYTHON; do
	name=${pair%%:*}; id=${pair#*:}
	b=$OUT/b-$name; mkdir -p "$b/rootfs"
	mount --bind "$BUNDLES/$id/rootfs" "$b/rootfs"
	# Copy each bind mount's source: kubelet and containerd remove theirs
	# with the old sandbox.
	jq -r '.mounts[] | select(.type=="bind" or (.options // [] | index("bind"))) | .source' "$BUNDLES/$id/config.json" > "$b/sources"
	cp "$BUNDLES/$id/config.json" "$b/config.orig.json"
	filter='.linux.namespaces |= map(if .type=="network" then .path="/var/run/netns/'$NETNS'" else . end) | del(.linux.cgroupsPath) | .annotations["io.kubernetes.cri.sandbox-id"]="spike-pause"'
	n=0
	while read -r src; do
		[ -e "$src" ] || continue
		n=$((n+1)); dst=$b/m$n
		cp -a "$src" "$dst"
		filter="$filter | .mounts |= map(if .source==\"$src\" then .source=\"$dst\" else . end)"
	done < "$b/sources"
	jq "$filter" "$b/config.orig.json" > "$b/config.json"
	echo "$name: $(jq -c '[.root.path, .annotations["io.kubernetes.cri.container-type"], .annotations["io.kubernetes.cri.container-name"], ([.mounts[].destination]|join(","))]' "$b/config.json")"
done
ip netns add $NETNS && ip -n $NETNS link set lo up

step "Q2c: runsc checkpoint WITHOUT --leave-running (the sandbox stops), then watch the pod"
repl 'print("x before final checkpoint", x)'
t=$(now)
$RUNSC_CLUSTER checkpoint --image-path "$OUT/ck-final" "$SB" 2>&1 | tail -5; rc=${PIPESTATUS[0]}
echo "rc=$rc took $(since "$t")"
du -sh "$OUT/ck-final"
$RUNSC_CLUSTER list
sleep 8
kubectl -n $NS get pod spike -o wide
kubectl -n $NS get pod spike -o jsonpath='{range .status.containerStatuses[*]}{.name} restarts={.restartCount} state={.state} last={.lastState}{"\n"}{end}'
kubectl -n $NS get events --sort-by=.lastTimestamp | tail -8

restore() { # restore IMAGE: restores pause, counter, python from IMAGE outside containerd
	local img=$1 t
	t=$(now)
	(cd "$OUT/b-pause" && $RUNSC_SPIKE restore --image-path "$img" --detach spike-pause) > "$OUT/restore-pause.log" 2>&1 || { echo "restore pause failed:"; tail -20 "$OUT/restore-pause.log"; return 1; }
	echo "pause restored $(since "$t")"
	for name in counter python; do
		(cd "$OUT/b-$name" && $RUNSC_SPIKE create spike-$name) > "$OUT/create-$name.log" 2>&1 || { echo "create $name failed:"; tail -20 "$OUT/create-$name.log"; return 1; }
		(cd "$OUT/b-$name" && $RUNSC_SPIKE restore --image-path "$img" --detach spike-$name) > "$OUT/restore-$name.log" 2>&1 || { echo "restore $name failed:"; tail -20 "$OUT/restore-$name.log"; return 1; }
		echo "$name restored $(since "$t")"
	done
	local c
	for k in $(seq 1 100); do
		if c=$($RUNSC_SPIKE exec spike-counter cat /tmp/count 2>/dev/null); then break; fi
		sleep 0.05
	done
	echo "first exec output (counter /tmp/count=$c) $(since "$t") after the restore began"
	sleep 1
	echo "counter a second later: $($RUNSC_SPIKE exec spike-counter cat /tmp/count 2>&1)"
	$RUNSC_SPIKE exec spike-python sh -c "echo 'print(\"x after restore\", x)' > /tmp/in; sleep 0.3; tail -n 3 /tmp/out" 2>&1
	$RUNSC_SPIKE exec spike-python sh -c 'ip addr 2>/dev/null || cat /proc/net/dev' 2>&1 | head -8
	$RUNSC_SPIKE list
}
unrestore() {
	for id in spike-python spike-counter spike-pause; do $RUNSC_SPIKE kill "$id" KILL >/dev/null 2>&1; $RUNSC_SPIKE delete --force "$id" 2>&1 | tail -2; done
}

step "Q3a: restore the final checkpoint outside containerd (runsc restore, new ids, new netns with lo only)"
restore "$OUT/ck-final"; unrestore
step "Q3b: restore the idle --leave-running checkpoint"
restore "$OUT/ck-idle"; unrestore
step "Q4b: restore the ${FILL_MIB} MiB checkpoint (default compression), then the uncompressed one"
restore "$OUT/ck-fill"; unrestore
restore "$OUT/ck-fill-raw"; unrestore
echo "spike done"
