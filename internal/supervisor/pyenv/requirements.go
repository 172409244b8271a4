package pyenv

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// Limits of a requirement set. They bound the command line the installer
// gets and the metadata kept per environment.
const (
	MaxRequirements      = 100
	MaxRequirementLength = 256
	MaxNameLength        = 64
)

// requirementRE accepts the part of PEP 508 that names a project on an
// index: name, extras, version specifiers and an environment marker. It
// refuses direct references ("name @ url"), paths, and anything starting
// with "-", which an installer would read as an option (-r file, -e path,
// --index-url): each of those would fetch from somewhere other than the
// configured indexes, past the allowlist.
var requirementRE = regexp.MustCompile(`^` +
	`([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)` + // name
	`[ \t]*(?:\[[ \t]*([A-Za-z0-9._-]+(?:[ \t]*,[ \t]*[A-Za-z0-9._-]+)*)?[ \t]*\])?` + // extras
	`[ \t]*((?:~=|===|==|!=|<=|>=|<|>)[ \t]*[A-Za-z0-9.*+!_-]+(?:[ \t]*,[ \t]*(?:~=|===|==|!=|<=|>=|<|>)[ \t]*[A-Za-z0-9.*+!_-]+)*)?` + // versions
	`[ \t]*(?:;[ \t]*([A-Za-z0-9_.<>=!~'" ()]*[A-Za-z0-9_.'")]))?` + // marker
	`[ \t]*$`)

var (
	specSpaceRE = regexp.MustCompile(`\s+`)
	separatorRE = regexp.MustCompile(`[-_.]+`)
	nameRE      = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)
)

// Requirement is one parsed requirement.
type Requirement struct {
	// Name is the project name normalised as PEP 503 does (lower case,
	// runs of "-", "_" and "." as one "-"), the form the allowlist and the
	// index use.
	Name string
	// String is the requirement in a canonical spelling: normalised name,
	// sorted extras, specifiers without spaces. It is what the installer is
	// given and what identifies the requirement in an environment's key.
	String string
}

// NormalizeName is PEP 503's normalisation of a project name.
func NormalizeName(name string) string {
	return strings.ToLower(separatorRE.ReplaceAllString(name, "-"))
}

// ParseRequirement parses one requirement string.
func ParseRequirement(s string) (Requirement, error) {
	if len(s) > MaxRequirementLength {
		return Requirement{}, fmt.Errorf("requirement %.40q... is longer than %d bytes", s, MaxRequirementLength)
	}
	m := requirementRE.FindStringSubmatch(s)
	if m == nil {
		if strings.Contains(s, "@") || strings.Contains(s, "://") || strings.ContainsAny(s, `/\`) {
			return Requirement{}, fmt.Errorf("requirement %q: only names from the configured package index are allowed, not URLs or paths", s)
		}
		return Requirement{}, fmt.Errorf("requirement %q is not of the form name[extras]<specifiers>[; marker], e.g. \"pandas>=2.0\"", s)
	}
	name := NormalizeName(m[1])
	var b strings.Builder
	b.WriteString(name)
	if m[2] != "" {
		var extras []string
		for _, e := range strings.Split(m[2], ",") {
			extras = append(extras, NormalizeName(strings.TrimSpace(e)))
		}
		slices.Sort(extras)
		extras = slices.Compact(extras)
		b.WriteString("[" + strings.Join(extras, ",") + "]")
	}
	b.WriteString(specSpaceRE.ReplaceAllString(m[3], ""))
	if m[4] != "" {
		b.WriteString("; " + strings.TrimSpace(specSpaceRE.ReplaceAllString(m[4], " ")))
	}
	return Requirement{Name: name, String: b.String()}, nil
}

// ParseRequirements parses a requirement set and returns it in canonical
// order (sorted, duplicates dropped), so that the same set spelled in
// another order names the same environment.
func ParseRequirements(list []string) ([]Requirement, error) {
	if len(list) > MaxRequirements {
		return nil, fmt.Errorf("%d requirements, more than the %d allowed", len(list), MaxRequirements)
	}
	out := make([]Requirement, 0, len(list))
	for _, s := range list {
		r, err := ParseRequirement(s)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b Requirement) int { return strings.Compare(a.String, b.String) })
	return slices.CompactFunc(out, func(a, b Requirement) bool { return a.String == b.String }), nil
}

// ValidName reports whether name may name an environment: it becomes part
// of a directory name, and names starting with "." are the manager's own.
func ValidName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("environment name must not be empty")
	case len(name) > MaxNameLength:
		return fmt.Errorf("environment name %.20q... is longer than %d bytes", name, MaxNameLength)
	case !nameRE.MatchString(name):
		return fmt.Errorf("environment name %q must start with a letter or digit and hold only letters, digits, '.', '_' and '-'", name)
	}
	return nil
}

// spec is what an environment is built from; two requests with equal
// specs can share an environment.
type spec struct {
	Requirements []string `json:"requirements"`
	IndexURL     string   `json:"index_url,omitempty"`
	ExtraIndexes []string `json:"extra_index_urls,omitempty"`
}

func (s spec) equal(o spec) bool {
	return slices.Equal(s.Requirements, o.Requirements) && s.IndexURL == o.IndexURL && slices.Equal(s.ExtraIndexes, o.ExtraIndexes)
}

// keyName is the name of the environment of the spec when it was asked
// for by its requirements alone.
func (s spec) keyName() string { return "reqs-" + s.key()[:16] }

// RequirementsKey is the name the environment of a requirement set gets
// in a sandbox whose package indexes are indexURL and extraIndexURLs (a
// template's python.indexURL and python.extraIndexURLs) when it is asked
// for by its requirements alone: the stable key under which sandboxes
// cache it, and by which the control plane routes a pool lease to a
// sandbox holding it. The supervisor names its environments with this
// same function.
func RequirementsKey(requirements []string, indexURL string, extraIndexURLs []string) (string, error) {
	reqs, err := ParseRequirements(requirements)
	if err != nil {
		return "", err
	}
	if len(reqs) == 0 {
		return "", fmt.Errorf("an environment key needs requirements")
	}
	sp := spec{IndexURL: indexURL, ExtraIndexes: extraIndexURLs}
	for _, q := range reqs {
		sp.Requirements = append(sp.Requirements, q.String)
	}
	return sp.keyName(), nil
}

// key is a digest of the spec, from which the name of an environment that
// was asked for by its requirements alone is made.
func (s spec) key() string {
	h := sha256.New()
	for _, r := range s.Requirements {
		fmt.Fprintf(h, "req %s\n", r)
	}
	fmt.Fprintf(h, "index %s\n", s.IndexURL)
	for _, u := range s.ExtraIndexes {
		fmt.Fprintf(h, "extra %s\n", u)
	}
	return hex.EncodeToString(h.Sum(nil))
}
