#!/bin/sh
# A three-step pipeline driven through the Compute API's runs, as a
# workflow engine's steps or a CI job would drive it:
#
#   pipeline.sh AGENT_ID WORKFLOW_ID
#
# Each step is one run in the agent's sandbox, started and followed by
# `agentbox runs start --follow`, which prints the step's output as it
# comes and exits with its command's exit code, so the pipeline stops at
# the first step that fails. The steps hand data on through the agent's
# workspace, which outlives each run.
#
# Every step's request id is made of the workflow id, the step's name and
# STEP_ATTEMPT (default 0), so starting the pipeline again with the same
# workflow id does not run a finished step a second time: its start
# returns the run it made before, whose output is replayed and whose exit
# code stands. To run failed steps again, give a new STEP_ATTEMPT (a
# workflow engine passes its retry number).
#
# Needs the agentbox CLI on PATH and its connection in the environment
# (AGENTBOX_ENDPOINT, AGENTBOX_TOKEN or AGENTBOX_TOKEN_FILE, and
# AGENTBOX_CA_FILE for a private CA).
set -eu

if [ $# -ne 2 ]; then
	echo "usage: $0 AGENT_ID WORKFLOW_ID" >&2
	exit 2
fi
agent=$1
workflow=$2
attempt=${STEP_ATTEMPT:-0}

step() {
	name=$1
	shift
	echo "== $name" >&2
	agentbox runs start --follow --workflow-id "$workflow" --request-id "$workflow-$name-$attempt" \
		--timeout 5m "$agent" -- "$@"
}

# 1. Fetch: here, write the input the next steps read.
step fetch sh -c 'mkdir -p pipeline && printf "%s\n" alpha beta gamma >pipeline/input.txt && echo "fetched $(wc -l <pipeline/input.txt) lines"'
# 2. Transform: sort the lines in reverse and count them.
step transform sh -c 'sort -r pipeline/input.txt >pipeline/sorted.txt && echo "sorted: $(tr "\n" " " <pipeline/sorted.txt)"'
# 3. Report: what the earlier steps left in the workspace.
step report sh -c 'echo "report: first=$(head -n 1 pipeline/sorted.txt) lines=$(wc -l <pipeline/sorted.txt)"'
