package chart

import (
	"encoding/json"
	"fmt"
	"reflect"

	"sigs.k8s.io/yaml"
)

// imageKeys are the images under `image` in values.yaml. ImageTag and
// ImagePullPolicy apply to all of them: they are built from one commit.
var imageKeys = []string{"controlPlane", "sandbox", "supervisor", "egressProxy"}

// Values are the chart values a typed caller (the Terraform resource) sets.
// Zero fields are left to the chart's defaults. Raw is YAML merged on top,
// so it can set anything values.yaml documents, including what the typed
// fields set.
type Values struct {
	ImageRegistry   string
	ImageTag        string
	ImagePullPolicy string
	// Replicas is the control plane's replicaCount; nil means the chart
	// default, so that 0 (stopped) can be asked for.
	Replicas *int
	// SandboxNamespaces are the namespaces served besides the release
	// namespace (sandboxNamespaces); nil leaves the chart's default.
	SandboxNamespaces []string
	Raw               string
}

// Map returns the values to give Helm: the typed fields, then Raw merged on
// top (maps merge key by key, anything else is replaced).
func (v Values) Map() (map[string]any, error) {
	out := map[string]any{}
	if v.ImageRegistry != "" {
		out["imageRegistry"] = v.ImageRegistry
	}
	if v.Replicas != nil {
		out["replicaCount"] = *v.Replicas
	}
	if v.SandboxNamespaces != nil {
		list := make([]any, len(v.SandboxNamespaces))
		for i, ns := range v.SandboxNamespaces {
			list[i] = ns
		}
		out["sandboxNamespaces"] = list
	}
	if v.ImageTag != "" || v.ImagePullPolicy != "" {
		images := map[string]any{}
		for _, k := range imageKeys {
			img := map[string]any{}
			if v.ImageTag != "" {
				img["tag"] = v.ImageTag
			}
			if v.ImagePullPolicy != "" {
				img["pullPolicy"] = v.ImagePullPolicy
			}
			images[k] = img
		}
		out["image"] = images
	}
	if v.Raw != "" {
		raw, err := ParseValues(v.Raw)
		if err != nil {
			return nil, err
		}
		mergeInto(out, raw)
	}
	return normalize(out)
}

// ParseValues parses a YAML document of chart values. Empty means none.
func ParseValues(s string) (map[string]any, error) {
	var m map[string]any
	if err := yaml.Unmarshal([]byte(s), &m); err != nil {
		return nil, fmt.Errorf("values are not a YAML map: %w", err)
	}
	if m == nil {
		m = map[string]any{}
	}
	return m, nil
}

// ValuesFromConfig is the inverse of Map: it splits the values a release was
// installed with (release.Config) back into typed fields and the Raw rest,
// so that an imported release, or one changed with plain Helm, can be
// described with the same attributes that would produce it. A field is only
// taken out of the rest when the rest then gives the same map again.
func ValuesFromConfig(config map[string]any) (Values, error) {
	rest, err := normalize(config)
	if err != nil {
		return Values{}, err
	}
	var v Values
	if s, ok := rest["imageRegistry"].(string); ok && s != "" {
		v.ImageRegistry = s
		delete(rest, "imageRegistry")
	}
	if n, ok := rest["replicaCount"].(float64); ok && n >= 0 && n == float64(int(n)) {
		r := int(n)
		v.Replicas = &r
		delete(rest, "replicaCount")
	}
	if list, ok := rest["sandboxNamespaces"].([]any); ok && len(list) > 0 {
		var names []string
		for _, e := range list {
			if s, ok := e.(string); ok {
				names = append(names, s)
			}
		}
		if len(names) == len(list) {
			v.SandboxNamespaces = names
			delete(rest, "sandboxNamespaces")
		}
	}
	v.ImageTag = takeCommon(rest, "tag")
	v.ImagePullPolicy = takeCommon(rest, "pullPolicy")
	prune(rest)
	if len(rest) > 0 {
		b, err := yaml.Marshal(rest)
		if err != nil {
			return Values{}, err
		}
		v.Raw = string(b)
	}

	// A safety net for the cases above that cannot round-trip (for example a
	// null that Raw must keep): then everything stays in Raw.
	again, err := v.Map()
	if err != nil {
		return Values{}, err
	}
	if !reflect.DeepEqual(again, mustNormalize(config)) {
		b, err := yaml.Marshal(config)
		if err != nil {
			return Values{}, err
		}
		return Values{Raw: string(b)}, nil
	}
	return v, nil
}

// SameValues reports whether two value maps mean the same to Helm, whatever
// their Go types (int or float64 after a trip through JSON).
func SameValues(a, b map[string]any) bool {
	na, errA := normalize(a)
	nb, errB := normalize(b)
	if errA != nil || errB != nil {
		return false
	}
	if len(na) == 0 && len(nb) == 0 {
		return true
	}
	return reflect.DeepEqual(na, nb)
}

// takeCommon removes image.<each>.<key> when all images have the same string
// value for it, and returns that value.
func takeCommon(values map[string]any, key string) string {
	images, ok := values["image"].(map[string]any)
	if !ok {
		return ""
	}
	var common string
	for i, k := range imageKeys {
		img, ok := images[k].(map[string]any)
		if !ok {
			return ""
		}
		s, ok := img[key].(string)
		if !ok || s == "" || (i > 0 && s != common) {
			return ""
		}
		common = s
	}
	for _, k := range imageKeys {
		delete(images[k].(map[string]any), key)
	}
	return common
}

// prune removes maps left empty by takeCommon; a user would not have
// written them.
func prune(m map[string]any) {
	for k, v := range m {
		if sub, ok := v.(map[string]any); ok {
			prune(sub)
			if len(sub) == 0 {
				delete(m, k)
			}
		}
	}
}

// mergeInto merges src into dst: maps key by key, anything else replaced.
// Unlike Helm's coalescing it keeps nulls, which tell Helm to drop a
// default.
func mergeInto(dst, src map[string]any) {
	for k, sv := range src {
		if sm, ok := sv.(map[string]any); ok {
			if dm, ok := dst[k].(map[string]any); ok {
				mergeInto(dm, sm)
				continue
			}
		}
		dst[k] = sv
	}
}

// normalize gives values the types they have after Helm stores and reads
// back a release (JSON), so that maps from either side compare equal.
func normalize(m map[string]any) (map[string]any, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("values cannot be encoded: %w", err)
	}
	out := map[string]any{}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, err
	}
	if out == nil {
		out = map[string]any{}
	}
	return out, nil
}

func mustNormalize(m map[string]any) map[string]any {
	n, err := normalize(m)
	if err != nil {
		return nil
	}
	return n
}
