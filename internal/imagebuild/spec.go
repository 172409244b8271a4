package imagebuild

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/distribution/reference"

	"github.com/agentbox/terraform-provider-agentbox/internal/ociimage"
)

// Spec describes an image made from Debian packages: the sandbox images are
// built-in specs (StandardSpec, MinimalSpec), and `agentbox-images -spec`
// reads one from a JSON file, so a team without Docker can make its own
// variant. No spec adds the supervisor: the platform injects it into every
// sandbox pod, so any image can be a sandbox.
type Spec struct {
	// Ref is the image reference written into the archive, e.g.
	// example.com/team/sandbox:1. Without a tag, the build's tag is used.
	Ref string `json:"ref"`
	// Base is BaseStandard, BaseMinimal or BaseNone: the package list
	// (and, but for none, the sandbox's files and image config) the
	// image starts from.
	Base string `json:"base"`
	// Packages are Debian packages added to the base's; their hard
	// dependencies come with them.
	Packages []string `json:"packages,omitempty"`
	// Exclude names packages left out, with whatever only they pulled in;
	// added to the base's.
	Exclude []string `json:"exclude,omitempty"`
	// Files are host files copied into the image.
	Files []SpecFile `json:"files,omitempty"`
	// Links maps a path in the image to the target of a symbolic link
	// made there (busybox's applets, alternatives).
	Links map[string]string `json:"links,omitempty"`

	// The image config. Unset fields keep the base's; Env adds to the
	// base's environment, a variable named in both taking Env's value.
	Entrypoint []string          `json:"entrypoint,omitempty"`
	Cmd        []string          `json:"cmd,omitempty"`
	Env        map[string]string `json:"env,omitempty"`
	User       string            `json:"user,omitempty"`
	WorkingDir string            `json:"workingDir,omitempty"`

	// Name is what logs call the image and names its archive,
	// <Name>.tar: the spec file's name without .json.
	Name string `json:"-"`
}

// SpecFile is one host file copied into an image.
type SpecFile struct {
	// From is the file on the host; a relative path is taken from the
	// folder of the spec file.
	From string `json:"from"`
	// Path is where the file goes in the image (absolute).
	Path string `json:"path"`
	// Mode is the file's permissions in octal, e.g. "0755"; unset keeps
	// the host file's.
	Mode string `json:"mode,omitempty"`
}

// The bases a spec starts from.
const (
	// BaseStandard is the standard sandbox image's packages, files and
	// config (StandardPackages).
	BaseStandard = "standard"
	// BaseMinimal is the minimal sandbox image's (MinimalPackages).
	BaseMinimal = "minimal"
	// BaseNone is nothing: the image holds what its packages and files
	// give, the merged-/usr links and an empty, world-writable /tmp.
	BaseNone = "none"
)

// Bases lists the values Spec.Base takes.
var Bases = []string{BaseStandard, BaseMinimal, BaseNone}

// StandardPackages make the standard sandbox: what an agent reaches for
// on a Debian machine. bash and the GNU tools scripts assume; curl, git
// and openssh-client to fetch code; jq, zip and xz for the data they
// bring; python3 with pip and venv (the supervisor builds its cached
// environments with venv's ensurepip, which Debian strips from python3);
// build-essential and python3-dev so that pip can build native wheels;
// python-is-python3 for the `python` that agents type;
// ca-certificates for its licence and certificate sources (its maintainer
// script never runs: SandboxFiles puts the bundle in place); dash for the
// /bin/sh that `sh -c` and subprocess(shell=True) run; tar for kubectl cp;
// tzdata for time zones (Python's zoneinfo reads it); apt, so that an
// image built FROM this one can `apt-get install` (the build writes dpkg's
// database and the host's Debian sources for it), with the rest of
// Debian's Essential packages, which maintainer scripts take for granted
// (dpkg itself runs ldconfig, from libc-bin; gzip, which tar needs for
// .tar.gz, is one); and usr-is-merged, the marker that the layout is
// merged already, where init-system-helpers' first choice would be
// usrmerge, the tool that merges it.
var StandardPackages = []string{
	"bash", "coreutils", "findutils", "grep", "sed", "gawk", "diffutils", "patch", "less", "procps",
	"curl", "ca-certificates", "git", "openssh-client", "jq", "unzip", "zip", "xz-utils",
	"python3", "python3-pip", "python3-venv", "python3-dev", "python-is-python3", "build-essential",
	"dash", "tar", "tzdata", "apt", "usr-is-merged",
	// Essential: yes, beside those above.
	"base-files", "base-passwd", "bsdutils", "gzip", "hostname", "libc-bin", "login",
	"ncurses-base", "ncurses-bin", "sysvinit-utils", "util-linux",
}

// MinimalPackages make the minimal sandbox: python3 rather than
// python3-minimal, whose standard library lacks json and venv;
// python3-venv for ensurepip; coreutils because agents expect ls, cat and
// friends; dash for /bin/sh; tar for kubectl cp and archives.
var MinimalPackages = []string{"python3", "python3-venv", "dash", "coreutils", "tar"}

// MinimalExclude leaves dpkg out of the minimal sandbox: python3's packages
// depend on it for their maintainer scripts, which never run in an
// unpacked, read-only image (tar, which dpkg needs, is listed for its own
// sake). The standard sandbox keeps it, for apt.
var MinimalExclude = []string{"dpkg"}

// StandardLinks are the alternatives the standard packages' maintainer
// scripts would make (update-alternatives), which no unpacked image has:
// awk, cc and pager are what scripts, make and pip call.
var StandardLinks = map[string]string{
	"/usr/bin/awk":    "gawk",
	"/usr/bin/nawk":   "gawk",
	"/usr/bin/cc":     "gcc",
	"/usr/bin/c89":    "c89-gcc",
	"/usr/bin/c99":    "c99-gcc",
	"/usr/bin/c++":    "g++",
	"/usr/bin/pager":  "less",
	"/usr/bin/lzma":   "xz",
	"/usr/bin/unlzma": "unxz",
	"/usr/bin/lzcat":  "xzcat",
	"/usr/bin/which":  "which.debianutils",
}

// MinimalLinks are the minimal packages' alternatives.
var MinimalLinks = map[string]string{"/usr/bin/which": "which.debianutils"}

// sandboxEnv is the environment of both sandbox bases. The Go runtime
// setting the supervisor needs (GODEBUG) is not here: the platform sets
// it in the pod for the supervisor.
var sandboxEnv = []string{
	ociimage.DefaultPath,
	"HOME=/workspace",
	"LANG=C.UTF-8",
	// The root file system is read-only; Python would try and fail to
	// write __pycache__ next to every module it imports.
	"PYTHONDONTWRITEBYTECODE=1",
	// An agent's first `pip install` works, as in a Python image: the
	// root file system is read-only, so pip installs for the user, into
	// ~/.local in the workspace, where it survives idle stops. Debian's
	// "externally managed" guard protects a system's apt-installed
	// Python, which here nothing can change anyway.
	"PIP_BREAK_SYSTEM_PACKAGES=1",
}

// base is what a Spec.Base stands for.
type base struct {
	packages, exclude []string
	links             map[string]string
	// sandboxFiles: SandboxFiles lays out the sandbox user, /workspace,
	// /tmp and the CA bundle.
	sandboxFiles bool
	config       ImageConfig
}

var bases = map[string]base{
	BaseStandard: {StandardPackages, nil, StandardLinks, true, ImageConfig{
		Cmd: []string{"/bin/bash"}, Env: sandboxEnv, User: sandboxUser, WorkingDir: "/workspace"}},
	BaseMinimal: {MinimalPackages, MinimalExclude, MinimalLinks, true, ImageConfig{
		Cmd: []string{"/bin/sh"}, Env: sandboxEnv, User: sandboxUser, WorkingDir: "/workspace"}},
	BaseNone: {},
}

var sandboxUser = fmt.Sprintf("%d:%d", NonRootUID, NonRootUID)

// ImageConfig is the part of an image's config a spec decides.
type ImageConfig struct {
	Entrypoint []string `json:"entrypoint,omitempty"`
	Cmd        []string `json:"cmd,omitempty"`
	Env        []string `json:"env,omitempty"`
	User       string   `json:"user,omitempty"`
	WorkingDir string   `json:"workingDir,omitempty"`
}

// StandardSpec is the standard sandbox image at ref.
func StandardSpec(ref string) *Spec {
	return &Spec{Ref: ref, Base: BaseStandard, Name: "agentbox-" + Sandbox}
}

// MinimalSpec is the minimal sandbox image at ref.
func MinimalSpec(ref string) *Spec {
	return &Spec{Ref: ref, Base: BaseMinimal, Name: "agentbox-" + SandboxMinimal}
}

// LoadSpec reads and validates a spec file. Files' relative From paths are
// made absolute from the spec file's folder, and each must be a readable
// regular file, so that a mistake shows before anything is downloaded.
func LoadSpec(file string) (*Spec, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	s, err := ParseSpec(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	s.Name = strings.TrimSuffix(filepath.Base(file), ".json")
	dir := filepath.Dir(file)
	for i := range s.Files {
		f := &s.Files[i]
		if !filepath.IsAbs(f.From) {
			f.From = filepath.Join(dir, f.From)
		}
		if f.From, err = filepath.Abs(f.From); err != nil {
			return nil, err
		}
		fi, err := os.Stat(f.From)
		if err != nil {
			return nil, fmt.Errorf("%s: files[%d]: %w", file, i, err)
		}
		if !fi.Mode().IsRegular() {
			return nil, fmt.Errorf("%s: files[%d]: %s is not a regular file (copy folders file by file)", file, i, f.From)
		}
	}
	return s, nil
}

// ParseSpec decodes a spec, refusing unknown fields, and validates it.
func ParseSpec(b []byte) (*Spec, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var s Spec
	if err := dec.Decode(&s); err != nil {
		return nil, fmt.Errorf("not a valid image spec: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("not a valid image spec: more than one JSON value")
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return &s, nil
}

// debianName is Debian policy's package name syntax.
var debianName = regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]+$`)

// Validate checks the spec without touching the host's files or apt; all
// problems are reported together, one a line.
func (s *Spec) Validate() error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if s.Ref == "" {
		add("ref is required (the image reference to write, e.g. example.com/team/sandbox:1)")
	} else if _, err := specRef(s.Ref, "latest"); err != nil {
		add("ref: %w", err)
	}
	if _, ok := bases[s.Base]; !ok {
		add("base %q: must be one of %s", s.Base, strings.Join(Bases, ", "))
	}
	if s.Base == BaseNone && len(s.Packages) == 0 {
		add("base none needs packages: an image of files alone is a static image, not a Debian one")
	}
	for field, names := range map[string][]string{"packages": s.Packages, "exclude": s.Exclude} {
		for i, n := range names {
			if !debianName.MatchString(n) {
				add("%s[%d]: %q is not a Debian package name", field, i, n)
			}
		}
	}
	for _, n := range s.Packages {
		if slices.Contains(s.Exclude, n) {
			add("package %s is both in packages and in exclude", n)
		}
	}
	seen := map[string]string{}
	claim := func(field, p string) {
		if prev, ok := seen[p]; ok {
			add("%s: %s is also %s", field, p, prev)
		}
		seen[p] = field
	}
	for i, f := range s.Files {
		field := fmt.Sprintf("files[%d]", i)
		if f.From == "" {
			add("%s: from (the host file) is required", field)
		}
		if err := imagePath(f.Path); err != nil {
			add("%s: path: %w", field, err)
		} else {
			claim(field, path.Clean(f.Path))
		}
		if f.Mode != "" {
			if _, err := parseMode(f.Mode); err != nil {
				add("%s: %w", field, err)
			}
		}
	}
	for _, p := range slices.Sorted(maps.Keys(s.Links)) {
		field := fmt.Sprintf("links[%q]", p)
		if err := imagePath(p); err != nil {
			add("%s: %w", field, err)
		} else {
			claim(field, path.Clean(p))
		}
		if t := s.Links[p]; t == "" || strings.ContainsRune(t, 0) {
			add("%s: the target must be a non-empty path", field)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(s.Env)) {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			add("env: %q is not a variable name", k)
		}
	}
	if s.User != "" && strings.ContainsAny(s.User, " \t\n") {
		add("user %q: must be a user (name or uid), optionally :group", s.User)
	}
	if s.WorkingDir != "" && !path.IsAbs(s.WorkingDir) {
		add("workingDir %q: must be an absolute path", s.WorkingDir)
	}
	if len(errs) > 1 {
		msgs := make([]string, len(errs))
		for i, e := range errs {
			msgs[i] = e.Error()
		}
		return fmt.Errorf("%d problems:\n  %s", len(errs), strings.Join(msgs, "\n  "))
	}
	return errors.Join(errs...)
}

// imagePath checks a path inside the image: absolute, clean, and not the
// root itself.
func imagePath(p string) error {
	switch {
	case p == "":
		return errors.New("is required")
	case !path.IsAbs(p):
		return fmt.Errorf("%q must be absolute", p)
	case path.Clean(p) != p:
		return fmt.Errorf("%q is not clean (no .., //, or trailing /)", p)
	case p == "/":
		return errors.New(`"/" is the image's root, not a file`)
	case strings.ContainsRune(p, 0):
		return fmt.Errorf("%q contains NUL", p)
	}
	return nil
}

func parseMode(s string) (os.FileMode, error) {
	m, err := strconv.ParseUint(s, 8, 32)
	if err != nil || m > 0o7777 {
		return 0, fmt.Errorf("mode %q: must be octal permissions, e.g. \"0755\"", s)
	}
	mode := os.FileMode(m).Perm()
	if m&0o4000 != 0 {
		mode |= os.ModeSetuid
	}
	if m&0o2000 != 0 {
		mode |= os.ModeSetgid
	}
	if m&0o1000 != 0 {
		mode |= os.ModeSticky
	}
	return mode, nil
}

// specRef is the normalised reference of a spec's ref: its own tag, or tag
// when it has none.
func specRef(ref, tag string) (string, error) {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil {
		return "", fmt.Errorf("%q: %w", ref, err)
	}
	if _, ok := named.(reference.Digested); ok {
		return "", fmt.Errorf("%q: a digest cannot be written, name a tag", ref)
	}
	if _, ok := named.(reference.Tagged); ok {
		return named.String(), nil
	}
	if tag == "" {
		return "", fmt.Errorf("%q has no tag, and no tag was given for the build (-tag)", ref)
	}
	tagged, err := reference.WithTag(named, tag)
	if err != nil {
		return "", fmt.Errorf("%q with tag %q: %w", ref, tag, err)
	}
	return tagged.String(), nil
}

// resolved is a spec with its base applied: what the build does.
type resolved struct {
	packages, exclude []string
	sandboxFiles      bool
	config            ImageConfig
	files             []SpecFile
	links             map[string]string
}

// resolve applies the spec's base.
func (s *Spec) resolve() resolved {
	b := bases[s.Base]
	r := resolved{
		packages:     appendNew(slices.Clone(b.packages), s.Packages...),
		exclude:      appendNew(slices.Clone(b.exclude), s.Exclude...),
		sandboxFiles: b.sandboxFiles,
		config:       b.config,
		files:        s.Files,
		links:        maps.Clone(b.links),
	}
	if r.links == nil {
		r.links = map[string]string{}
	}
	maps.Copy(r.links, s.Links)
	for _, f := range s.Files {
		// A file the spec puts where the base has a link replaces it.
		delete(r.links, f.Path)
	}
	// A package the spec adds back is not excluded by the base.
	r.exclude = slices.DeleteFunc(r.exclude, func(n string) bool { return slices.Contains(s.Packages, n) })
	if s.Entrypoint != nil {
		r.config.Entrypoint = s.Entrypoint
	}
	if s.Cmd != nil {
		r.config.Cmd = s.Cmd
	}
	if s.User != "" {
		r.config.User = s.User
	}
	if s.WorkingDir != "" {
		r.config.WorkingDir = s.WorkingDir
	}
	r.config.Env = mergeEnv(b.config.Env, s.Env)
	return r
}

// mergeEnv overrides base's variables with env's and appends env's others,
// sorted. Without either, the image gets PATH alone (ociimage's default).
func mergeEnv(base []string, env map[string]string) []string {
	out := slices.Clone(base)
	left := maps.Clone(env)
	for i, kv := range out {
		k, _, _ := strings.Cut(kv, "=")
		if v, ok := left[k]; ok {
			out[i] = k + "=" + v
			delete(left, k)
		}
	}
	if len(out) == 0 && len(left) > 0 {
		if _, ok := left["PATH"]; !ok {
			out = append(out, ociimage.DefaultPath)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(left)) {
		out = append(out, k+"="+left[k])
	}
	return out
}

func appendNew(list []string, names ...string) []string {
	for _, n := range names {
		if !slices.Contains(list, n) {
			list = append(list, n)
		}
	}
	return list
}
