package imagebuild

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestParseSpecErrors(t *testing.T) {
	for _, c := range []struct {
		name, spec string
		want       []string // substrings of the error
	}{
		{"unknown field", `{"ref": "a/b:1", "base": "none", "packages": ["x1"], "package": ["y"]}`, []string{`unknown field "package"`}},
		{"not an object", `["a"]`, []string{"not a valid image spec"}},
		{"wrong type", `{"ref": "a/b:1", "base": "none", "packages": "python3"}`, []string{"not a valid image spec", "packages"}},
		{"two values", `{"ref": "a/b:1", "base": "minimal"} {}`, []string{"more than one JSON value"}},
		{"missing ref", `{"base": "minimal"}`, []string{"ref is required"}},
		{"bad ref", `{"ref": "Upper/Case:1", "base": "minimal"}`, []string{"ref:", "Upper/Case"}},
		{"digest ref", `{"ref": "a/b@sha256:` + strings.Repeat("0", 64) + `", "base": "minimal"}`, []string{"digest cannot be written"}},
		{"missing base", `{"ref": "a/b:1"}`, []string{`base "": must be one of standard, minimal, none`}},
		{"unknown base", `{"ref": "a/b:1", "base": "debian"}`, []string{`base "debian"`}},
		{"none without packages", `{"ref": "a/b:1", "base": "none"}`, []string{"base none needs packages"}},
		{"bad package name", `{"ref": "a/b:1", "base": "minimal", "packages": ["python3 pip", "Git"]}`,
			[]string{`packages[0]: "python3 pip" is not a Debian package name`, `packages[1]: "Git"`}},
		{"bad exclude", `{"ref": "a/b:1", "base": "minimal", "exclude": ["-x"]}`, []string{`exclude[0]: "-x"`}},
		{"package excluded", `{"ref": "a/b:1", "base": "minimal", "packages": ["git"], "exclude": ["git"]}`, []string{"git is both"}},
		{"relative path", `{"ref": "a/b:1", "base": "minimal", "files": [{"from": "x", "path": "etc/x"}]}`, []string{`files[0]: path: "etc/x" must be absolute`}},
		{"unclean path", `{"ref": "a/b:1", "base": "minimal", "files": [{"from": "x", "path": "/etc/../x"}]}`, []string{"is not clean"}},
		{"root path", `{"ref": "a/b:1", "base": "minimal", "links": {"/": "x"}}`, []string{`"/" is the image's root`}},
		{"no from", `{"ref": "a/b:1", "base": "minimal", "files": [{"path": "/etc/x"}]}`, []string{"from (the host file) is required"}},
		{"bad mode", `{"ref": "a/b:1", "base": "minimal", "files": [{"from": "x", "path": "/x", "mode": "rwx"}]}`, []string{`mode "rwx"`}},
		{"mode too big", `{"ref": "a/b:1", "base": "minimal", "files": [{"from": "x", "path": "/x", "mode": "17777"}]}`, []string{`mode "17777"`}},
		{"file and link on one path", `{"ref": "a/b:1", "base": "minimal", "files": [{"from": "x", "path": "/bin/x"}], "links": {"/bin/x": "y"}}`,
			[]string{`links["/bin/x"]: /bin/x is also files[0]`}},
		{"empty link target", `{"ref": "a/b:1", "base": "minimal", "links": {"/bin/x": ""}}`, []string{"target must be a non-empty path"}},
		{"env name", `{"ref": "a/b:1", "base": "minimal", "env": {"A=B": "c"}}`, []string{`env: "A=B"`}},
		{"relative workingDir", `{"ref": "a/b:1", "base": "minimal", "workingDir": "work"}`, []string{`workingDir "work"`}},
		{"user with space", `{"ref": "a/b:1", "base": "minimal", "user": "a b"}`, []string{`user "a b"`}},
		// Every problem at once, not the first alone.
		{"several", `{"base": "x", "packages": ["A"]}`, []string{"ref is required", `base "x"`, `packages[0]: "A"`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := ParseSpec([]byte(c.spec))
			if err == nil {
				t.Fatalf("accepted %s", c.spec)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}

func TestLoadSpec(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "tool"), []byte("#!/bin/sh\n"), 0o750); err != nil {
		t.Fatal(err)
	}
	write := func(name, spec string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(spec), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	s, err := LoadSpec(write("team-image.json", `{"ref": "example.com/team/img", "base": "standard",
		"files": [{"from": "tool", "path": "/usr/local/bin/tool"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	// Relative host paths are the spec file's folder's.
	if s.Name != "team-image" || s.Files[0].From != filepath.Join(dir, "tool") {
		t.Errorf("name %q, from %q", s.Name, s.Files[0].From)
	}
	if m, err := fileMode(s.Files[0]); err != nil || m != 0o750 {
		t.Errorf("mode without a mode in the spec: %v, %v; want the host file's 0750", m, err)
	}

	// The host file is checked before anything is built.
	if _, err := LoadSpec(write("missing.json", `{"ref": "a/b:1", "base": "minimal", "files": [{"from": "nope", "path": "/x"}]}`)); err == nil ||
		!strings.Contains(err.Error(), "missing.json: files[0]") || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("missing host file: %v", err)
	}
	if _, err := LoadSpec(write("dir.json", `{"ref": "a/b:1", "base": "minimal", "files": [{"from": ".", "path": "/x"}]}`)); err == nil ||
		!strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("a folder as a file: %v", err)
	}
	if _, err := LoadSpec(write("bad.json", `{"ref": "a/b:1", "base": "minimal", "extra": 1}`)); err == nil ||
		!strings.Contains(err.Error(), "bad.json: ") || !strings.Contains(err.Error(), `unknown field "extra"`) {
		t.Errorf("unknown field: %v", err)
	}
}

func TestBuiltinSpecs(t *testing.T) {
	std := StandardSpec("x").resolve()
	for _, p := range []string{"bash", "coreutils", "findutils", "grep", "sed", "gawk", "diffutils", "patch", "less",
		"procps", "curl", "ca-certificates", "git", "openssh-client", "jq", "unzip", "zip", "xz-utils", "python3",
		"python3-pip", "python3-venv", "build-essential", "dash", "tar",
		// for apt-get install FROM it, and what its scripts take for granted
		"apt", "gzip", "libc-bin"} {
		if !slices.Contains(std.packages, p) {
			t.Errorf("the standard image lacks %s", p)
		}
	}
	min := MinimalSpec("x").resolve()
	if want := []string{"python3", "python3-venv", "dash", "coreutils", "tar"}; !slices.Equal(min.packages, want) {
		t.Errorf("minimal packages %v, want %v", min.packages, want)
	}
	// The standard image keeps dpkg, for apt; the minimal one has no use
	// for it.
	if len(std.exclude) != 0 || !slices.Equal(min.exclude, []string{"dpkg"}) {
		t.Errorf("exclude: standard %v, minimal %v", std.exclude, min.exclude)
	}
	for name, r := range map[string]resolved{"standard": std, "minimal": min} {
		if !r.sandboxFiles {
			t.Errorf("%s: no sandbox files", name)
		}
		c := r.config
		if c.User != "65532:65532" || c.WorkingDir != "/workspace" || c.Entrypoint != nil {
			t.Errorf("%s: config %+v", name, c)
		}
		for _, e := range []string{"HOME=/workspace", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1", "PIP_BREAK_SYSTEM_PACKAGES=1"} {
			if !slices.Contains(c.Env, e) {
				t.Errorf("%s: env %v lacks %s", name, c.Env, e)
			}
		}
		for _, e := range c.Env {
			// The platform sets it in the pod, for the supervisor.
			if strings.HasPrefix(e, "GODEBUG=") {
				t.Errorf("%s: image env has %s", name, e)
			}
		}
		if !strings.HasPrefix(c.Env[0], "PATH=") {
			t.Errorf("%s: env %v does not start with PATH", name, c.Env)
		}
	}
	if !slices.Equal(std.config.Cmd, []string{"/bin/bash"}) || !slices.Equal(min.config.Cmd, []string{"/bin/sh"}) {
		t.Errorf("cmd: standard %v, minimal %v", std.config.Cmd, min.config.Cmd)
	}
	if std.links["/usr/bin/cc"] != "gcc" || std.links["/usr/bin/awk"] != "gawk" {
		t.Errorf("standard links %v", std.links)
	}
	// Changing a resolved spec leaves the built-in lists alone.
	std.links["/x"] = "y"
	std.packages[0] = "changed"
	if StandardLinks["/x"] != "" || StandardPackages[0] == "changed" {
		t.Error("resolve shares the base's lists")
	}
}

func TestResolveOnBase(t *testing.T) {
	s, err := ParseSpec([]byte(`{"ref": "a/b:1", "base": "standard", "packages": ["ripgrep", "git"],
		"exclude": ["python3-dev"], "env": {"LANG": "de_DE.UTF-8", "EDITOR": "vi"}, "user": "1000",
		"links": {"/usr/bin/awk": "mawk", "/usr/local/bin/fd": "/usr/bin/fdfind"},
		"files": [{"from": "x", "path": "/usr/bin/pager"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	r := s.resolve()
	if !slices.Contains(r.packages, "ripgrep") || strings.Count(strings.Join(r.packages, " "), " git ") != 1 {
		t.Errorf("packages %v: ripgrep added, git once", r.packages)
	}
	if !slices.Equal(r.exclude, []string{"python3-dev"}) {
		t.Errorf("exclude %v", r.exclude)
	}
	// dpkg, asked for, is not excluded by the base any more.
	withDpkg, err := ParseSpec([]byte(`{"ref": "a/b:1", "base": "minimal", "packages": ["dpkg"]}`))
	if err != nil {
		t.Fatal(err)
	}
	if r := withDpkg.resolve(); slices.Contains(r.exclude, "dpkg") || !slices.Contains(r.packages, "dpkg") {
		t.Errorf("minimal with dpkg: packages %v, exclude %v", r.packages, r.exclude)
	}
	wantEnv := []string{StandardSpec("").resolve().config.Env[0], "HOME=/workspace", "LANG=de_DE.UTF-8", "PYTHONDONTWRITEBYTECODE=1", "PIP_BREAK_SYSTEM_PACKAGES=1", "EDITOR=vi"}
	if !slices.Equal(r.config.Env, wantEnv) {
		t.Errorf("env %v, want %v", r.config.Env, wantEnv)
	}
	if r.config.User != "1000" || r.config.WorkingDir != "/workspace" || !slices.Equal(r.config.Cmd, []string{"/bin/bash"}) {
		t.Errorf("config %+v: the spec's user, the base's working dir and cmd", r.config)
	}
	if r.links["/usr/bin/awk"] != "mawk" || r.links["/usr/local/bin/fd"] != "/usr/bin/fdfind" || r.links["/usr/bin/cc"] != "gcc" {
		t.Errorf("links %v", r.links)
	}
	if _, ok := r.links["/usr/bin/pager"]; ok {
		t.Error("a file the spec puts where the base has a link keeps the link")
	}

	none, err := ParseSpec([]byte(`{"ref": "a/b", "base": "none", "packages": ["busybox"], "cmd": ["sh"], "env": {"A": "1"}}`))
	if err != nil {
		t.Fatal(err)
	}
	r = none.resolve()
	if r.sandboxFiles || len(r.exclude) != 0 || !slices.Equal(r.packages, []string{"busybox"}) || len(r.links) != 0 {
		t.Errorf("base none: %+v", r)
	}
	if r.config.User != "" || r.config.WorkingDir != "" || !slices.Equal(r.config.Env, []string{StandardSpec("").resolve().config.Env[0], "A=1"}) {
		t.Errorf("base none config %+v: no user, no working dir, PATH and A", r.config)
	}
}

func TestJobs(t *testing.T) {
	std, _ := ParseSpec([]byte(`{"ref": "example.com/team/sandbox", "base": "standard"}`))
	std.Name = "team"
	tagged, _ := ParseSpec([]byte(`{"ref": "agentbox-test/busybox:7", "base": "none", "packages": ["busybox"]}`))
	tagged.Name = "test-busybox"

	jobs, err := (&Options{Tag: "dev"}).jobs()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, j := range jobs {
		names = append(names, j.archive)
		if (j.spec == nil) == (j.binary == "") {
			t.Errorf("%s: a job is a static image or a Debian one", j.name)
		}
	}
	want := []string{"agentbox-controlplane.tar", "agentbox-egress-proxy.tar", "agentbox-supervisor.tar",
		"agentbox-sandbox.tar", "agentbox-sandbox-minimal.tar"}
	if !slices.Equal(names, want) {
		t.Errorf("default archives %v, want %v", names, want)
	}

	// Specs alone build no built-in image, and need no tag when their ref
	// has one.
	jobs, err = (&Options{Specs: []*Spec{tagged}}).jobs()
	if err != nil || len(jobs) != 1 || jobs[0].archive != "test-busybox.tar" || jobs[0].ref != "docker.io/agentbox-test/busybox:7" {
		t.Fatalf("spec alone: %+v, %v", jobs, err)
	}
	jobs, err = (&Options{Tag: "dev", Only: []string{Sandbox}, Specs: []*Spec{std, tagged}}).jobs()
	if err != nil || len(jobs) != 3 || jobs[1].ref != "example.com/team/sandbox:dev" || jobs[2].ref != "docker.io/agentbox-test/busybox:7" {
		t.Fatalf("-only with specs: %+v, %v", jobs, err)
	}
	if jobs[0].spec.Base != BaseStandard || jobs[0].ref != "docker.io/agentbox/agentbox-sandbox:dev" {
		t.Errorf("the sandbox image is the standard spec: %+v", jobs[0])
	}

	for _, c := range []struct {
		o    Options
		want string
	}{
		{Options{Specs: []*Spec{std}}, "has no tag"},
		{Options{Only: []string{Sandbox}}, "a tag is required"},
		{Options{Tag: "dev", Only: []string{"sandbox-fat"}}, `unknown image "sandbox-fat"`},
		{Options{Tag: "dev", Specs: []*Spec{tagged, tagged}}, "two images would be written to test-busybox.tar"},
		{Options{Tag: "dev", Specs: []*Spec{{Ref: "a/b", Base: "none", Name: "x"}}}, "base none needs packages"},
	} {
		if _, err := c.o.jobs(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: err %v, want %q", c.o, err, c.want)
		}
	}
}

// The repository's spec files parse: the foreign test images and the
// example.
func TestRepositorySpecs(t *testing.T) {
	files, err := filepath.Glob("testdata/foreign/*.json")
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, "../../examples/images/custom-sandbox.json")
	if len(files) != 4 {
		t.Fatalf("spec files %v", files)
	}
	for _, f := range files {
		s, err := LoadSpec(f)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if strings.HasPrefix(s.Name, "test-") {
			// Not ours in spirit: no sandbox base, user or working dir;
			// node's user is its own 1000, as in the official image.
			wantUser := ""
			if s.Name == "test-node" {
				wantUser = "1000:1000"
			}
			if s.Base != BaseNone || s.User != wantUser || s.WorkingDir != "" || len(s.Cmd) == 0 {
				t.Errorf("%s: %+v", f, s)
			}
		}
	}
}

func TestAddFiles(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{"usr/bin", "etc"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("usr/bin", filepath.Join(root, "bin")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "usr/bin/busybox"), []byte("bb"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc/motd"), []byte("from a package"), 0o644); err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(t.TempDir(), "motd")
	if err := os.WriteFile(src, []byte("the team's"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := addFiles(root, []SpecFile{{From: src, Path: "/etc/motd", Mode: "0644"}, {From: src, Path: "/opt/team/notes"}},
		map[string]string{"/bin/sh": "busybox", "/usr/local/bin/ls": "/bin/busybox"})
	if err != nil {
		t.Fatal(err)
	}
	// A file replaces the package's, with the spec's mode or the host's.
	for p, want := range map[string]os.FileMode{"etc/motd": 0o644, "opt/team/notes": 0o600} {
		fi, err := os.Stat(filepath.Join(root, p))
		if err != nil || fi.Mode() != want {
			t.Errorf("%s: %v %v, want %v", p, fi, err, want)
		}
	}
	// /bin/sh lands in usr/bin, as a merged /usr has it.
	if target, err := os.Readlink(filepath.Join(root, "usr/bin/sh")); err != nil || target != "busybox" {
		t.Errorf("usr/bin/sh: %q %v", target, err)
	}
	if fi, err := os.Lstat(filepath.Join(root, "bin")); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("/bin is no longer the merged-/usr link: %v", err)
	}

	err = addFiles(root, nil, map[string]string{"/bin/awk": "gawk"})
	if err == nil || !strings.Contains(err.Error(), "link /bin/awk -> gawk: the target is not in the image") {
		t.Errorf("a dangling link: %v", err)
	}
	// An absolute target is the image's, not the host's.
	hostOnly, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	err = addFiles(root, nil, map[string]string{"/usr/local/bin/host-only": hostOnly})
	if err == nil || !strings.Contains(err.Error(), "the target is not in the image") {
		t.Errorf("a link to a path only the host has: %v", err)
	}
}

func TestDebianSources(t *testing.T) {
	const policy = `Package files:
 100 /dev/null
     release a=now
 500 http://archive.example/debian-security bookworm-security/main amd64 Packages
     release v=12,o=Debian,a=oldstable-security,n=bookworm-security,l=Debian-Security,c=main,b=amd64
     origin archive.example
 500 http://archive.example/debian bookworm/contrib amd64 Packages
     release v=12.15,o=Debian,a=oldstable,n=bookworm,l=Debian,c=contrib,b=amd64
     origin archive.example
 500 http://archive.example/debian bookworm/main amd64 Packages
     release v=12.15,o=Debian,a=oldstable,n=bookworm,l=Debian,c=main,b=amd64
     origin archive.example
 500 https://vendor.example/node nodistro/main amd64 Packages
     release o=Vendor,a=nodistro,n=nodistro,l=Vendor,c=main,b=amd64
     origin vendor.example
Pinned packages:
`
	got := debianSources([]byte(policy))
	want := []aptSource{
		{"http://archive.example/debian-security", "bookworm-security", []string{"main"}},
		{"http://archive.example/debian", "bookworm", []string{"contrib", "main"}},
	}
	if len(got) != len(want) {
		t.Fatalf("sources %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i].uri != want[i].uri || got[i].suite != want[i].suite || !slices.Equal(got[i].components, want[i].components) {
			t.Errorf("source %d: %+v, want %+v", i, got[i], want[i])
		}
	}
}

func TestWithStatus(t *testing.T) {
	got := withStatus("Package: tar\nVersion: 1.34\nDescription: GNU tar\n more\n")
	want := "Package: tar\nStatus: install ok installed\nVersion: 1.34\nDescription: GNU tar\n more\n"
	if got != want {
		t.Errorf("withStatus:\n%s\nwant\n%s", got, want)
	}
	if f := controlFields("Package: libc6\nMulti-Arch: same\nDescription: x\n Multi-Arch: no\n"); f["Multi-Arch"] != "same" || f["Package"] != "libc6" {
		t.Errorf("controlFields: %v", f)
	}
	if got, want := listPath("./"), "/."; got != want {
		t.Errorf("listPath(./) = %q", got)
	}
	if got := listPath("./usr/bin/"); got != "/usr/bin" {
		t.Errorf("listPath(./usr/bin/) = %q", got)
	}
}
