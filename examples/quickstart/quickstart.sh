#!/usr/bin/env bash
# The quickstart, end to end on the local cluster: `make quickstart` runs
# `quickstart.sh up`, `make quickstart-down` runs `quickstart.sh down`.
#
#   up:   check the prerequisites, build the provider, the images and what
#         the local cluster runs, start the cluster with its gVisor node (or
#         reuse the running one), terraform init + apply this folder, then
#         run a command in the agent's sandbox through the Compute API.
#   down: terraform destroy, stop the cluster, remove the work folder.
set -euo pipefail
shopt -s inherit_errexit 2>/dev/null || true
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
GO=${GO:-go}
tag=${IMAGE_TAG:-dev}
version=${PROVIDER_VERSION:-0.1.0}
build=$repo/.build
work=$build/quickstart
images=$build/images
mirror=$build/mirror
testenv() { "$build/bin/agentbox-testenv" "$@"; }
export TF_CLI_CONFIG_FILE=$work/terraformrc TF_IN_AUTOMATION=1

steps=()
step() {
	local name=$1; shift
	local start=$(date +%s.%N)
	echo "==> $name"
	"$@"
	local secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
	steps+=("$(printf '%-44s %6ss' "$name" "$secs")")
}
report() {
	echo
	echo "Step times:"
	printf '  %s\n' "${steps[@]}"
}

# need NAME HOW: stop before building anything, with one line naming what is
# missing and how to get it.
need() {
	echo "quickstart: $1 is needed: $2" >&2
	exit 1
}

# The prerequisites, all checked in a second or two so that a missing one
# is said at once rather than after a long build.
preflight() {
	[ "$(id -u)" = 0 ] || need "root" "the local cluster runs containerd, the kubelet and gVisor on this machine; run as root (sudo make quickstart)"
	command -v "$GO" >/dev/null || need "Go" "install Go $(go_wanted) or newer (go.dev/doc/install)"
	local have want
	have=$($GO env GOVERSION | sed 's/^go//; s/[^0-9.].*//')
	want=$(go_wanted)
	[ "$(printf '%s\n%s\n' "$want" "$have" | sort -V | head -1)" = "$want" ] ||
		need "Go $want or newer" "found go$have; install a newer Go (go.dev/doc/install)"
	command -v terraform >/dev/null || need "terraform" "install Terraform 1.5 or newer (developer.hashicorp.com/terraform/install)"
	command -v kubectl >/dev/null || need "kubectl" "install kubectl (kubernetes.io/docs/tasks/tools), used to watch the cluster"
	command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null ||
		need "apt" "the cluster's packages and the sandbox image come from Debian packages; run on Debian or Ubuntu"
	if [ -z "$(apt-get indextargets --format '$(FILENAME)' 2>/dev/null | head -1)" ]; then
		echo "==> apt has no package lists yet: apt-get update"
		timeout 120 apt-get update -q >/dev/null 2>&1 || need "apt access" "apt-get update failed; check this machine's apt sources and proxy"
	fi
	echo "root, go$have, $(terraform version | head -1), kubectl, apt: ok"
}

go_wanted() { sed -n 's/^go \([0-9.]*\).*/\1/p' "$repo/go.mod"; }

build_all() {
	mkdir -p "$work" "$mirror" "$build/bin"
	# One build for the four: they share most packages and link side by
	# side. hack/gobuild.sh says how far along it is every 10 seconds.
	GO=$GO ./hack/gobuild.sh "$build/bin/" "$version" ./internal/cmd/agentbox-testenv ./internal/cmd/agentbox-images ./internal/cmd/agentbox .
	local dir=$mirror/registry.terraform.io/agentbox/agentbox/$version/linux_amd64
	mkdir -p "$dir"
	cp "$build/bin/terraform-provider-agentbox" "$dir/terraform-provider-agentbox_v$version"
	# Terraform installs the provider from this mirror like from a registry,
	# so `terraform init` runs as it would for a user.
	cat > "$TF_CLI_CONFIG_FILE" <<RC
provider_installation {
  filesystem_mirror {
    path    = "$mirror"
    include = ["registry.terraform.io/agentbox/agentbox"]
  }
  direct {
    exclude = ["registry.terraform.io/agentbox/agentbox"]
  }
}
RC
}

build_images() {
	# What the quickstart's cluster runs; the minimal sandbox image is
	# for templates that ask for it (make images builds it).
	"$build/bin/agentbox-images" -out "$images" -tag "$tag" -only controlplane,egress-proxy,supervisor,sandbox
}

# Only what the quickstart's cluster runs: the servers that only tests start
# (S3, the snapshot and CSI sidecars, PostgreSQL) are left to `make test`,
# which builds them into the same cache and reuses the rest.
build_cluster() {
	testenv build -cluster-only
}

start_cluster() {
	testenv up -node -reuse \
		-image "$images/agentbox-controlplane.tar" \
		-image "$images/agentbox-supervisor.tar" \
		-image "$images/agentbox-sandbox.tar" \
		-image "$images/agentbox-egress-proxy.tar" > "$work/kubeconfig.path"
}

tf_init() {
	mkdir -p "$work/tf"
	cp examples/quickstart/*.tf "$work/tf/"
	# The provider binary is rebuilt on every run; its old hash must go.
	rm -f "$work/tf/.terraform.lock.hcl"
	terraform -chdir="$work/tf" init -input=false -no-color >/dev/null
}

tf_apply() {
	# A second `make quickstart` finds the platform in terraform's state:
	# apply then changes only what changed, usually nothing.
	if terraform -chdir="$work/tf" state list 2>/dev/null | grep -q '^agentbox_platform\.'; then
		already_up=1
		echo "The platform is already up (terraform state in $work/tf); applying only what changed."
	fi
	# The outputs (the CA certificate among them) are shown briefly below
	# rather than dumped by apply.
	terraform -chdir="$work/tf" apply -input=false -auto-approve -no-color \
		-var "kubeconfig=$(cat "$work/kubeconfig.path")" -var "image_tag=$tag" | sed '/^Outputs:/,$d'
	echo "api_endpoint = $(terraform -chdir="$work/tf" output -raw api_endpoint)"
	echo "agent_id     = $(terraform -chdir="$work/tf" output -raw agent_id)"
}

run_command() {
	terraform -chdir="$work/tf" output -raw ca_certificate > "$work/ca.crt"
	(umask 077; terraform -chdir="$work/tf" output -raw admin_token > "$work/admin-token")
	local endpoint agent
	endpoint=$(terraform -chdir="$work/tf" output -raw api_endpoint)
	agent=$(terraform -chdir="$work/tf" output -raw agent_id)
	echo "\$ agentbox run-command $agent -- python3 -c \"import platform; print(platform.release())\""
	"$build/bin/agentbox" run-command --endpoint "$endpoint" --ca-file "$work/ca.crt" --token-file "$work/admin-token" \
		"$agent" -- python3 -c "import platform; print(platform.release())"
	# What the README's idle stop walk-through sources: the CLI, the API,
	# and terraform with the provider mirror and the cluster.
	cat > "$work/env" <<ENV
export PATH="$build/bin:\$PATH"
export TF_CLI_CONFIG_FILE="$TF_CLI_CONFIG_FILE"
export KUBECONFIG="$(cat "$work/kubeconfig.path")"
export AGENTBOX_ENDPOINT="$endpoint"
export AGENTBOX_CA_FILE="$work/ca.crt"
export AGENTBOX_TOKEN="\$(cat "$work/admin-token")"
ENV
}

down() {
	if [ -f "$work/kubeconfig.path" ] && [ -d "$work/tf/.terraform" ]; then
		terraform -chdir="$work/tf" destroy -input=false -auto-approve -no-color \
			-var "kubeconfig=$(cat "$work/kubeconfig.path")" -var "image_tag=$tag" || echo "terraform destroy failed; stopping the cluster anyway"
	fi
	if [ -x "$build/bin/agentbox-testenv" ]; then testenv down; else $GO run ./internal/cmd/agentbox-testenv down; fi
	# The images and the testenv cache stay, so the next quickstart only
	# starts the cluster and applies.
	rm -rf "$work"
}

case "${1:-up}" in
up)
	already_up=
	step "check the prerequisites" preflight
	trap report EXIT
	step "build the provider, the CLI and the tools" build_all
	step "build the images" build_images
	step "build what the cluster runs" build_cluster
	step "start the local cluster, import the images" start_cluster
	step "terraform init" tf_init
	step "terraform apply" tf_apply
	step "run_command in the agent's sandbox" run_command
	echo
	[ -z "$already_up" ] || echo "The platform was already up; terraform applied only what had changed."
	echo "The sandbox is up; idle sandboxes are kept in the $(terraform -chdir="$work/tf" output -raw snapshot_driver) snapshot store."
	echo "To watch an idle stop and resume, see the README (Quickstart): . $work/env, then shorten idle_timeout."
	echo "Tear everything down with: make quickstart-down"
	;;
down)
	trap report EXIT
	step "terraform destroy and stop the cluster" down
	;;
*)
	echo "usage: $0 up|down" >&2
	exit 2
	;;
esac
