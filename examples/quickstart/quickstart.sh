#!/usr/bin/env bash
# The quickstart, end to end on the local cluster: `make quickstart` runs
# `quickstart.sh up`, `make quickstart-down` runs `quickstart.sh down`.
#
#   up:   build the provider and the images, start the local cluster with its
#         gVisor node, terraform init + apply this folder, then run a command
#         in the agent's sandbox through the Compute API.
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
testenv() { "$build/agentbox-testenv" "$@"; }
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

build_all() {
	mkdir -p "$work" "$mirror"
	$GO build -o "$build/agentbox-testenv" ./internal/cmd/agentbox-testenv
	$GO build -o "$build/agentbox" ./internal/cmd/agentbox
	local dir=$mirror/registry.terraform.io/agentbox/agentbox/$version/linux_amd64
	mkdir -p "$dir"
	$GO build -trimpath -ldflags "-s -w -X main.version=$version" -o "$dir/terraform-provider-agentbox_v$version" .
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
	$GO run ./internal/cmd/agentbox-images -out "$images" -tag "$tag"
}

start_cluster() {
	$GO run ./internal/cmd/agentbox-testenv build
	testenv up -node -reuse \
		-image "$images/agentbox-controlplane.tar" \
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
	"$build/agentbox" run-command --endpoint "$endpoint" --ca-file "$work/ca.crt" --token-file "$work/admin-token" \
		"$agent" -- python3 -c "import platform; print(platform.release())"
	# What the README's idle stop walk-through sources: the CLI, the API,
	# and terraform with the provider mirror and the cluster.
	cat > "$work/env" <<ENV
export PATH="$build:\$PATH"
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
	$GO run ./internal/cmd/agentbox-testenv down
	rm -rf "$work"
}

case "${1:-up}" in
up)
	trap report EXIT
	step "build the provider, the CLI and the images" build_all
	step "start the local cluster, import the images" start_cluster
	step "terraform init" tf_init
	step "terraform apply" tf_apply
	step "run_command in the agent's sandbox" run_command
	echo
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
