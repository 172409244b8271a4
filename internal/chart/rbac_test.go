package chart

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"
)

// sandboxChildren are the namespaced kinds a sandbox or egress proxy is made
// of. The control plane may hold rights over them only in the namespaces
// the platform serves, through the Roles there, never cluster-wide.
var sandboxChildren = []struct{ group, resource string }{
	{"", "pods"}, {"", "persistentvolumeclaims"}, {"", "secrets"}, {"", "services"}, {"", "configmaps"},
	{"apps", "deployments"}, {"networking.k8s.io", "networkpolicies"}, {"coordination.k8s.io", "leases"},
	{"snapshot.storage.k8s.io", "volumesnapshots"},
}

// rbacOf is the RBAC a render gives the control plane's ServiceAccount:
// the ClusterRoles bound to it cluster-wide, and the Roles bound to it in
// each namespace.
type rbacOf struct {
	cluster map[string][]rbacv1.PolicyRule
	roles   map[string][]rbacv1.PolicyRule // by namespace: every bound Role's rules
	// sandboxRoles maps each namespace holding the sandbox Role to its rules.
	sandboxRoles map[string][]rbacv1.PolicyRule
}

func controlPlaneRBAC(r *rendered) rbacOf {
	r.t.Helper()
	out := rbacOf{cluster: map[string][]rbacv1.PolicyRule{}, roles: map[string][]rbacv1.PolicyRule{}, sandboxRoles: map[string][]rbacv1.PolicyRule{}}
	isControlPlane := func(subjects []rbacv1.Subject) bool {
		return len(subjects) == 1 && subjects[0].Kind == "ServiceAccount" && subjects[0].Name == "agentbox-controlplane" && subjects[0].Namespace == testNamespace
	}
	clusterRoles := map[string]*rbacv1.ClusterRole{}
	roles := map[string]*rbacv1.Role{}
	for _, o := range r.objects {
		switch o := o.(type) {
		case *rbacv1.ClusterRole:
			clusterRoles[o.Name] = o
		case *rbacv1.Role:
			roles[o.Namespace+"/"+o.Name] = o
		}
	}
	for _, o := range r.objects {
		switch b := o.(type) {
		case *rbacv1.ClusterRoleBinding:
			cr, ok := clusterRoles[b.RoleRef.Name]
			if b.RoleRef.Kind != "ClusterRole" || !ok || !isControlPlane(b.Subjects) {
				r.t.Errorf("ClusterRoleBinding %s: ref %+v, subjects %+v", b.Name, b.RoleRef, b.Subjects)
				continue
			}
			out.cluster[cr.Name] = cr.Rules
		case *rbacv1.RoleBinding:
			role, ok := roles[b.Namespace+"/"+b.RoleRef.Name]
			if b.RoleRef.Kind != "Role" || !ok || !isControlPlane(b.Subjects) {
				r.t.Errorf("RoleBinding %s/%s: ref %+v, subjects %+v (want a Role of its namespace, bound to the control plane)", b.Namespace, b.Name, b.RoleRef, b.Subjects)
				continue
			}
			out.roles[b.Namespace] = append(out.roles[b.Namespace], role.Rules...)
			if role.Name == "agentbox-controlplane-"+testNamespace {
				out.sandboxRoles[b.Namespace] = role.Rules
			}
		}
	}
	return out
}

func grants(rules []rbacv1.PolicyRule, group, resource, verb string) bool {
	return slices.ContainsFunc(rules, func(r rbacv1.PolicyRule) bool {
		return slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) && slices.Contains(r.Verbs, verb)
	})
}

func (a rbacOf) clusterGrants(group, resource, verb string) bool {
	for _, rules := range a.cluster {
		if grants(rules, group, resource, verb) {
			return true
		}
	}
	return false
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func TestRBAC(t *testing.T) {
	r := render(t, Values{})
	a := controlPlaneRBAC(r)
	if len(a.cluster) != 1 {
		t.Fatalf("cluster roles %v, want the one ClusterRole", sortedKeys(a.cluster))
	}
	for _, res := range []string{"sandboxes", "sandboxtemplates", "sandboxwarmpools", "egressproxies", "gvisornodepools"} {
		if !a.clusterGrants("agentbox.dev", res, "watch") || !a.clusterGrants("agentbox.dev", res+"/status", "update") {
			t.Errorf("cannot watch %s in every namespace or update its status", res)
		}
	}
	if !a.clusterGrants("agentbox.dev", "runschedules", "watch") || !a.clusterGrants("agentbox.dev", "runschedules/status", "patch") {
		t.Error("cannot watch run schedules in every namespace or write their status")
	}
	if a.clusterGrants("agentbox.dev", "runschedules", "update") || a.clusterGrants("agentbox.dev", "runschedules", "delete") {
		t.Error("may write or delete run schedules, which Terraform owns")
	}
	if !a.clusterGrants("agentbox.dev", "sandboxwarmpools/scale", "update") {
		t.Error("cannot scale warm pools")
	}
	if a.clusterGrants("agentbox.dev", "sandboxtemplates", "create") || a.clusterGrants("agentbox.dev", "sandboxtemplates", "delete") {
		t.Error("may create or delete templates, which Terraform owns")
	}
	if !a.clusterGrants("", "persistentvolumes", "watch") || a.clusterGrants("", "persistentvolumes", "delete") || a.clusterGrants("", "persistentvolumes", "patch") {
		t.Error("persistentvolumes: want read-only (node loss is read from their node affinity)")
	}
	if !a.clusterGrants("", "namespaces", "watch") || a.clusterGrants("", "namespaces", "patch") {
		t.Error("namespaces: want read-only")
	}
	// The NamespaceNotServed event goes to objects outside the served
	// namespaces.
	if !a.clusterGrants("", "events", "create") || !a.clusterGrants("events.k8s.io", "events", "create") {
		t.Error("cannot record events in every namespace")
	}
	// Managed node pools create their own RuntimeClass and label and taint
	// their nodes, through patches only.
	if !a.clusterGrants("node.k8s.io", "runtimeclasses", "watch") || !a.clusterGrants("node.k8s.io", "runtimeclasses", "create") ||
		a.clusterGrants("node.k8s.io", "runtimeclasses", "update") {
		t.Error("runtimeclasses: want watch and create, and patch rather than update")
	}
	if !a.clusterGrants("", "nodes", "patch") || a.clusterGrants("", "nodes", "update") || a.clusterGrants("", "nodes", "create") || a.clusterGrants("", "nodes/status", "patch") {
		t.Error("nodes: want patch only, and nothing on their status")
	}
	// Nothing a sandbox is made of is granted cluster-wide.
	for _, c := range sandboxChildren {
		for _, rules := range a.cluster {
			for _, rule := range rules {
				if slices.Contains(rule.APIGroups, c.group) && slices.Contains(rule.Resources, c.resource) {
					t.Errorf("the ClusterRole grants %v on %q/%s; it belongs in the served namespaces' Roles", rule.Verbs, c.group, c.resource)
				}
			}
		}
	}

	// By default the release namespace is the one namespace served.
	if got := sortedKeys(a.sandboxRoles); !slices.Equal(got, []string{testNamespace}) {
		t.Errorf("sandbox Roles in %v, want [%s]", got, testNamespace)
	}
	rules := a.sandboxRoles[testNamespace]
	for _, res := range []string{"pods", "persistentvolumeclaims", "secrets", "services", "configmaps"} {
		if !grants(rules, "", res, "create") || !grants(rules, "", res, "watch") {
			t.Errorf("cannot create or watch %s in the served namespace", res)
		}
	}
	if !grants(rules, "networking.k8s.io", "networkpolicies", "create") || !grants(rules, "coordination.k8s.io", "leases", "update") ||
		!grants(rules, "apps", "deployments", "create") {
		t.Error("missing networkpolicies, leases or deployments in the served namespace")
	}
	for _, verb := range []string{"create", "get"} {
		if grants(rules, "", "pods/exec", verb) || a.clusterGrants("", "pods/exec", verb) {
			t.Error("may exec into pods")
		}
	}
	// The control plane's own needs in the release namespace.
	own := must[*rbacv1.Role](r, "agentbox-controlplane-leader-election")
	if own.Namespace != testNamespace || !grants(own.Rules, "coordination.k8s.io", "leases", "update") || !grants(own.Rules, "", "configmaps", "update") ||
		!grants(own.Rules, "apps", "deployments", "get") || !grants(own.Rules, "", "services", "get") || grants(own.Rules, "", "secrets", "get") {
		t.Errorf("release namespace Role %+v", own)
	}
	if v, _ := envValue(container(t, r.deployment()), "AGENTBOX_SANDBOX_NAMESPACES"); v.Value != testNamespace {
		t.Errorf("AGENTBOX_SANDBOX_NAMESPACES %q, want %q", v.Value, testNamespace)
	}

	// The default driver, archive with the embedded store, needs no
	// snapshot rights at all.
	for _, rs := range append(slices.Collect(mapValues(a.cluster)), rules) {
		for _, rule := range rs {
			if slices.Contains(rule.APIGroups, "snapshot.storage.k8s.io") || slices.Contains(rule.APIGroups, "storage.k8s.io") {
				t.Errorf("the default archive driver gets snapshot or storage rights: %+v", rule)
			}
		}
	}
	vs := controlPlaneRBAC(renderRaw(t, "snapshot: {driver: volumesnapshot}\nsandboxNamespaces: [agents]"))
	for _, ns := range []string{testNamespace, "agents"} {
		if !grants(vs.sandboxRoles[ns], "snapshot.storage.k8s.io", "volumesnapshots", "create") {
			t.Errorf("volumesnapshot driver without VolumeSnapshot rights in %s", ns)
		}
	}
	// Its check reads the classes, and writes none of them.
	if !vs.clusterGrants("snapshot.storage.k8s.io", "volumesnapshotclasses", "list") || !vs.clusterGrants("storage.k8s.io", "storageclasses", "get") ||
		vs.clusterGrants("snapshot.storage.k8s.io", "volumesnapshotclasses", "create") || vs.clusterGrants("storage.k8s.io", "storageclasses", "update") {
		t.Error("volumesnapshot driver: want read-only rights on VolumeSnapshotClasses and StorageClasses")
	}
}

func mapValues[V any](m map[string]V) func(func(V) bool) {
	return func(yield func(V) bool) {
		for _, k := range sortedKeys(m) {
			if !yield(m[k]) {
				return
			}
		}
	}
}

// TestRBACSandboxNamespaces checks that the served namespaces, and only
// they, get the sandbox Role, and that the control plane's cache is told
// the same list.
func TestRBACSandboxNamespaces(t *testing.T) {
	r := renderRaw(t, "sandboxNamespaces: [team-b, agents]")
	a := controlPlaneRBAC(r)
	want := []string{testNamespace, "agents", "team-b"}
	if got := sortedKeys(a.sandboxRoles); !slices.Equal(got, want) {
		t.Errorf("sandbox Roles in %v, want %v", got, want)
	}
	for _, ns := range want {
		if !grants(a.sandboxRoles[ns], "", "secrets", "get") || !grants(a.sandboxRoles[ns], "", "pods", "create") {
			t.Errorf("%s: the sandbox Role does not cover Secrets and pods", ns)
		}
	}
	if v, _ := envValue(container(t, r.deployment()), "AGENTBOX_SANDBOX_NAMESPACES"); v.Value != strings.Join(want, ",") {
		t.Errorf("AGENTBOX_SANDBOX_NAMESPACES %q, want %q", v.Value, strings.Join(want, ","))
	}
	// Naming the release namespace again changes nothing.
	again := controlPlaneRBAC(renderRaw(t, "sandboxNamespaces: ["+testNamespace+"]"))
	if got := sortedKeys(again.sandboxRoles); !slices.Equal(got, []string{testNamespace}) {
		t.Errorf("sandbox Roles in %v", got)
	}
	for _, bad := range []string{"sandboxNamespaces: [Agents]", "sandboxNamespaces: [agents, agents]", "sandboxNamespaces: ['']", "sandboxNamespaces: agents"} {
		if _, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: bad}); err == nil {
			t.Errorf("%s: rendered, want a schema error", bad)
		}
	}
}

// TestRBACManagedNodePools checks that the right to patch nodes and write
// RuntimeClasses goes with managedNodePools, and the control plane is told.
func TestRBACManagedNodePools(t *testing.T) {
	r := renderRaw(t, "managedNodePools: false")
	a := controlPlaneRBAC(r)
	if a.clusterGrants("", "nodes", "patch") || a.clusterGrants("node.k8s.io", "runtimeclasses", "create") ||
		a.clusterGrants("node.k8s.io", "runtimeclasses", "delete") || a.clusterGrants("node.k8s.io", "runtimeclasses", "patch") {
		t.Error("managedNodePools false still grants node patches or RuntimeClass writes")
	}
	if !a.clusterGrants("", "nodes", "watch") || !a.clusterGrants("node.k8s.io", "runtimeclasses", "watch") {
		t.Error("nodes and RuntimeClasses must stay readable (node loss, GKE pools)")
	}
	if v, _ := envValue(container(t, r.deployment()), "AGENTBOX_MANAGED_NODE_POOLS"); v.Value != "false" {
		t.Errorf("AGENTBOX_MANAGED_NODE_POOLS %q", v.Value)
	}
	if v, _ := envValue(container(t, render(t, Values{}).deployment()), "AGENTBOX_MANAGED_NODE_POOLS"); v.Value != "true" {
		t.Errorf("default AGENTBOX_MANAGED_NODE_POOLS %q", v.Value)
	}
	if _, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: "managedNodePools: false\nrunscInstaller: {enabled: true}"}); err == nil ||
		!strings.Contains(err.Error(), "managedNodePools") {
		t.Errorf("the runsc installer without Managed pools: %v, want a render error", err)
	}
}

// rbacReviewed is an entry of testdata/rbac-reviewed.yaml.
type rbacReviewed struct {
	ClusterRole string   `json:"clusterRole"`
	APIGroup    string   `json:"apiGroup"`
	Resource    string   `json:"resource"`
	Verbs       []string `json:"verbs"`
	Reason      string   `json:"reason"`
}

// sensitive reports whether a cluster-wide right reads credentials or runs
// code under another identity: any right over Secrets, creating pods (a
// pod may name any ServiceAccount of its namespace and mount any Secret),
// exec/attach, minting ServiceAccount tokens, writing RBAC, impersonating.
func sensitive(group, resource, verb string) bool {
	switch {
	case verb == "impersonate":
		return true
	case group == "" && resource == "secrets":
		return true
	case group == "" && resource == "pods" && verb == "create":
		return true
	case group == "" && slices.Contains([]string{"pods/exec", "pods/attach", "pods/portforward", "serviceaccounts/token", "nodes/proxy"}, resource):
		return true
	case group == "rbac.authorization.k8s.io" && verb != "get" && verb != "list" && verb != "watch":
		return true
	}
	return false
}

// TestRBACLeastPrivilege renders the chart as it is installed (default,
// highly available, several sandbox namespaces, the volumesnapshot driver,
// the runsc installer) and fails on any wildcard in any Role or ClusterRole,
// and on any sensitive cluster-wide right of the control plane that is not
// reviewed, with its reason, in testdata/rbac-reviewed.yaml.
func TestRBACLeastPrivilege(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("testdata", "rbac-reviewed.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var reviewed []rbacReviewed
	if err := yaml.UnmarshalStrict(raw, &reviewed); err != nil {
		t.Fatalf("rbac-reviewed.yaml: %v", err)
	}
	used := make([]bool, len(reviewed))
	for i, e := range reviewed {
		if e.ClusterRole == "" || e.Resource == "" || len(e.Verbs) == 0 || strings.TrimSpace(e.Reason) == "" {
			t.Errorf("reviewed entry %d %+v: clusterRole, resource, verbs and reason are required", i, e)
		}
	}
	renders := map[string]string{
		"default":           "",
		"HA":                haValues,
		"several":           "sandboxNamespaces: [agents, team-b, team-c]",
		"volumesnapshot":    "snapshot: {driver: volumesnapshot}\nsandboxNamespaces: [agents]",
		"runsc installer":   "runscInstaller: {enabled: true}",
		"network policy on": "networkPolicy: {enabled: true}",
		"no managed pools":  "managedNodePools: false",
	}
	for _, name := range sortedKeys(renders) {
		r := renderRaw(t, renders[name])
		for _, o := range r.objects {
			var rules []rbacv1.PolicyRule
			var what string
			switch o := o.(type) {
			case *rbacv1.ClusterRole:
				rules, what = o.Rules, "ClusterRole "+o.Name
				if o.AggregationRule != nil {
					t.Errorf("%s: %s aggregates other roles; its rights cannot be reviewed here", name, what)
				}
			case *rbacv1.Role:
				rules, what = o.Rules, "Role "+o.Namespace+"/"+o.Name
			default:
				continue
			}
			for _, rule := range rules {
				if slices.Contains(rule.Verbs, "*") || slices.Contains(rule.Resources, "*") || slices.Contains(rule.APIGroups, "*") ||
					slices.ContainsFunc(rule.Resources, func(res string) bool { return strings.HasSuffix(res, "/*") }) {
					t.Errorf("%s: %s has a wildcard rule %+v", name, what, rule)
				}
				if len(rule.NonResourceURLs) > 0 {
					t.Errorf("%s: %s grants non-resource URLs %v", name, what, rule.NonResourceURLs)
				}
			}
		}
		a := controlPlaneRBAC(r)
		for _, crName := range sortedKeys(a.cluster) {
			for _, rule := range a.cluster[crName] {
				for _, group := range rule.APIGroups {
					for _, res := range rule.Resources {
						for _, verb := range rule.Verbs {
							if !sensitive(group, res, verb) {
								continue
							}
							i := slices.IndexFunc(reviewed, func(e rbacReviewed) bool {
								return e.ClusterRole == crName && e.APIGroup == group && e.Resource == res && slices.Contains(e.Verbs, verb)
							})
							if i < 0 {
								t.Errorf("%s: ClusterRole %s grants %s on %q/%s in every namespace; confine it to the served namespaces' Roles, "+
									"or review it with its reason in testdata/rbac-reviewed.yaml", name, crName, verb, group, res)
								continue
							}
							used[i] = true
						}
					}
				}
			}
		}
	}
	for i, e := range reviewed {
		if !used[i] {
			t.Errorf("reviewed entry %+v: no render grants it any more; remove it", e)
		}
	}
}

// TestRBACCoversControllerMarkers keeps the chart's RBAC in line with the
// controllers' kubebuilder RBAC markers, the one list of what they use: a
// marker the chart does not grant would fail only on a real cluster, at the
// first API call that needs it. A namespaced right may come from the Role
// in each served namespace rather than the ClusterRole.
func TestRBACCoversControllerMarkers(t *testing.T) {
	src, err := os.ReadFile(filepath.Join("..", "controller", "rbac.go"))
	if err != nil {
		t.Fatal(err)
	}
	a := controlPlaneRBAC(renderRaw(t, "sandboxNamespaces: [agents]"))
	markers := 0
	for _, line := range strings.Split(string(src), "\n") {
		spec, ok := strings.CutPrefix(strings.TrimSpace(line), "// +kubebuilder:rbac:")
		if !ok {
			continue
		}
		markers++
		fields := map[string][]string{}
		for _, kv := range strings.Split(spec, ",") {
			k, v, _ := strings.Cut(kv, "=")
			fields[k] = strings.Split(strings.Trim(v, `"`), ";")
		}
		for _, group := range fields["groups"] {
			for _, res := range fields["resources"] {
				for _, verb := range fields["verbs"] {
					if a.clusterGrants(group, res, verb) {
						continue
					}
					for _, ns := range []string{testNamespace, "agents"} {
						if !grants(a.roles[ns], group, res, verb) {
							t.Errorf("rbac.go asks for %s on %q/%s; the chart grants it neither cluster-wide nor in served namespace %s", verb, group, res, ns)
						}
					}
				}
			}
		}
	}
	if markers < 10 {
		t.Fatalf("found only %d RBAC markers in rbac.go; has the marker format changed?", markers)
	}
}
