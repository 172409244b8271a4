package imagebuild

import (
	"bufio"
	"fmt"
	"io"
	"sort"
	"strings"
)

// DepGraph is the dependency information printed by
//
//	apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
//	    --no-breaks --no-replaces --no-enhances ROOTS...
//
// apt-cache follows every alternative and every provider of a virtual
// package, so its list of names is a superset of what is needed (for
// python3 it reaches perl through "media-types | mime-support"). Closure
// picks one alternative per dependency instead, as apt would.
type DepGraph struct {
	// Deps maps each real package to its Depends and PreDepends, each an
	// OR-group of alternatives in apt's order of preference.
	Deps map[string][][]Alternative
	// Virtual holds the names apt printed as <virtual>.
	Virtual map[string]bool
}

// Alternative is one choice within an OR-group.
type Alternative struct {
	Name string
	// Virtual names a package no real package is called; one of
	// Providers is installed instead.
	Virtual   bool
	Providers []string
}

// ParseDepends reads apt-cache depends output.
func ParseDepends(r io.Reader) (*DepGraph, error) {
	g := &DepGraph{Deps: map[string][][]Alternative{}, Virtual: map[string]bool{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var (
		cur     string // the package whose block is being read; "" inside a virtual's block
		group   []Alternative
		pending bool // the last dependency line began with "|": the group goes on
		lineNo  int
	)
	flush := func() {
		if cur != "" && len(group) > 0 {
			g.Deps[cur] = append(g.Deps[cur], group)
		}
		group, pending = nil, false
	}
	for sc.Scan() {
		lineNo++
		line := sc.Text()
		if strings.TrimSpace(line) == "" {
			continue
		}
		switch {
		case strings.HasPrefix(line, "    "):
			// A provider of the virtual package on the line above.
			if len(group) == 0 {
				return nil, fmt.Errorf("apt-cache depends line %d: provider %q outside a dependency", lineNo, strings.TrimSpace(line))
			}
			last := &group[len(group)-1]
			last.Providers = append(last.Providers, strings.TrimSpace(line))
		case line[0] == ' ':
			// "  Depends: name", " |Depends: name" or "  Depends: <virtual>".
			if !pending {
				flush()
			}
			or := len(line) > 1 && line[1] == '|'
			kind, target, ok := strings.Cut(strings.TrimSpace(strings.TrimLeft(line, " |")), ":")
			if !ok {
				return nil, fmt.Errorf("apt-cache depends line %d: %q has no dependency type", lineNo, line)
			}
			if kind != "Depends" && kind != "PreDepends" {
				// Asked away on the command line; ignored if apt prints
				// them anyway.
				pending = false
				continue
			}
			target = strings.TrimSpace(target)
			alt := Alternative{Name: target}
			if strings.HasPrefix(target, "<") && strings.HasSuffix(target, ">") {
				alt = Alternative{Name: target[1 : len(target)-1], Virtual: true}
			}
			group = append(group, alt)
			pending = or
		default:
			flush()
			name := strings.TrimSpace(line)
			if strings.HasPrefix(name, "<") && strings.HasSuffix(name, ">") {
				g.Virtual[name[1:len(name)-1]] = true
				cur = ""
				continue
			}
			cur = name
			if _, ok := g.Deps[cur]; !ok {
				g.Deps[cur] = nil
			}
		}
	}
	flush()
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading apt-cache depends output: %w", err)
	}
	return g, nil
}

// real reports whether name has a block of its own, i.e. is a package apt
// can install.
func (g *DepGraph) real(name string) bool {
	_, ok := g.Deps[name]
	return ok
}

// Closure returns, sorted, the packages to unpack for roots: every
// dependency group is satisfied by a package already chosen if one is, else
// by its first installable alternative, a virtual package by its first
// installable provider. A group naming an excluded package counts as
// satisfied, so excluding a package also drops what only it needed.
func (g *DepGraph) Closure(roots, exclude []string) ([]string, error) {
	excluded := map[string]bool{}
	for _, e := range exclude {
		excluded[e] = true
	}
	selected := map[string]bool{}
	var queue []string
	add := func(n string) {
		if !selected[n] {
			selected[n] = true
			queue = append(queue, n)
		}
	}
	for _, r := range roots {
		if !g.real(r) {
			return nil, fmt.Errorf("package %q is unknown to apt or virtual; name a real package", r)
		}
		add(r)
	}
	// base names without ":any"/":amd64": apt prints python3:any for
	// "Depends: python3:any" and the provider is python3 itself.
	base := func(n string) string { n, _, _ = strings.Cut(n, ":"); return n }

	for len(queue) > 0 {
		pkg := queue[0]
		queue = queue[1:]
	groups:
		for _, group := range g.Deps[pkg] {
			for _, alt := range group {
				for _, n := range append([]string{alt.Name, base(alt.Name)}, alt.Providers...) {
					if selected[n] || excluded[n] || excluded[base(n)] {
						continue groups
					}
				}
			}
			for _, alt := range group {
				if !alt.Virtual && g.real(alt.Name) {
					add(alt.Name)
					continue groups
				}
				if !alt.Virtual && g.real(base(alt.Name)) {
					add(base(alt.Name))
					continue groups
				}
				for _, p := range alt.Providers {
					if g.real(p) {
						add(p)
						continue groups
					}
				}
			}
			return nil, fmt.Errorf("%s: no installable package satisfies %s", pkg, formatGroup(group))
		}
	}
	out := make([]string, 0, len(selected))
	for n := range selected {
		out = append(out, n)
	}
	sort.Strings(out)
	return out, nil
}

func formatGroup(group []Alternative) string {
	var s []string
	for _, a := range group {
		s = append(s, a.Name)
	}
	return strings.Join(s, " | ")
}
