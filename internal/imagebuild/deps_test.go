package imagebuild

import (
	"os"
	"slices"
	"strings"
	"testing"
)

// testdata/apt-cache-depends-python3-dash.txt is the output of
//
//	apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
//	    --no-breaks --no-replaces --no-enhances python3 dash
//
// captured on Debian 12 (bookworm), amd64.
func TestClosureOfCapturedOutput(t *testing.T) {
	f, err := os.Open("testdata/apt-cache-depends-python3-dash.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	g, err := ParseDepends(f)
	if err != nil {
		t.Fatal(err)
	}
	// "media-types | mime-support" is one group of two alternatives.
	var found bool
	for _, group := range g.Deps["libpython3.11-stdlib"] {
		if len(group) == 2 && group[0].Name == "media-types" && group[1].Name == "mime-support" {
			found = true
		}
	}
	if !found {
		t.Errorf("alternatives of libpython3.11-stdlib not grouped: %+v", g.Deps["libpython3.11-stdlib"])
	}

	got, err := g.Closure([]string{"python3", "dash"}, []string{"dpkg"})
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Fields(`dash debianutils gcc-12-base libbz2-1.0 libc6 libcom-err2 libcrypt1 libdb5.3
		libexpat1 libffi8 libgcc-s1 libgssapi-krb5-2 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0
		liblzma5 libncursesw6 libnsl2 libpython3-stdlib libpython3.11-minimal libpython3.11-stdlib
		libreadline8 libsqlite3-0 libssl3 libtinfo6 libtirpc-common libtirpc3 libuuid1 media-types
		python3 python3-minimal python3.11 python3.11-minimal readline-common zlib1g`)
	if !slices.Equal(got, want) {
		t.Errorf("closure:\n got %v\nwant %v", got, want)
	}

	// apt-cache lists every alternative; the closure must not follow the
	// second ones (mime-support drags in mailcap and perl).
	withDpkg, err := g.Closure([]string{"python3", "dash"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"mime-support", "mailcap", "perl", "perl-base", "install-info", "cdebconf"} {
		if slices.Contains(withDpkg, p) {
			t.Errorf("closure follows a second alternative: has %s", p)
		}
	}
	for _, p := range []string{"dpkg", "tar", "libselinux1"} {
		if !slices.Contains(withDpkg, p) {
			t.Errorf("closure without exclusions lacks %s", p)
		}
		if slices.Contains(got, p) {
			t.Errorf("closure excluding dpkg still has %s", p)
		}
	}
}

// The python3-venv capture has virtual packages: <python3:any>,
// <python3.11-distutils> and debconf's "debconf | <debconf-2.0>".
func TestClosureThroughVirtualPackages(t *testing.T) {
	f, err := os.Open("testdata/apt-cache-depends-python3-venv.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	g, err := ParseDepends(f)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"python3:any", "python3.11-distutils", "debconf-2.0"} {
		if !g.Virtual[v] {
			t.Errorf("%s not recognised as virtual", v)
		}
	}
	got, err := g.Closure([]string{"python3-venv"}, []string{"dpkg"})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"python3", "python3-distutils", "python3.11-venv", "debconf", "media-types"} {
		if !slices.Contains(got, p) {
			t.Errorf("closure lacks %s: %v", p, got)
		}
	}
	for _, p := range []string{"cdebconf", "mime-support", "mailcap", "dpkg", "python3:any"} {
		if slices.Contains(got, p) {
			t.Errorf("closure has %s: %v", p, got)
		}
	}
}

func TestClosureAlternativesAndProviders(t *testing.T) {
	const out = `app
  Depends: <awk>
    gawk
    mawk
  Depends: libc6:any
 |Depends: first
  Depends: second
  Depends: <virtual-only>
    second
  Recommends: big
gawk
  Depends: libc6
mawk
  Depends: libc6
libc6
first
second
  Depends: libc6
big
broken
  Depends: ghost
<awk>
<virtual-only>
`
	g, err := ParseDepends(strings.NewReader(out))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		roots, exclude, want []string
	}{
		// awk: its first provider; libc6:any: libc6; first | second:
		// first; virtual-only: its provider second. No Recommends.
		{[]string{"app"}, nil, []string{"app", "first", "gawk", "libc6", "second"}},
		// A package chosen already satisfies a later group.
		{[]string{"mawk", "app"}, nil, []string{"app", "first", "libc6", "mawk", "second"}},
		// An excluded alternative satisfies its group.
		{[]string{"app"}, []string{"first"}, []string{"app", "gawk", "libc6", "second"}},
	} {
		got, err := g.Closure(c.roots, c.exclude)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("Closure(%v, exclude %v) = %v, %v; want %v", c.roots, c.exclude, got, err, c.want)
		}
	}
	if _, err := g.Closure([]string{"broken"}, nil); err == nil || !strings.Contains(err.Error(), "ghost") {
		t.Errorf("a dependency on an unknown package: err = %v", err)
	}
	if _, err := g.Closure([]string{"awk"}, nil); err == nil {
		t.Error("a virtual root was accepted")
	}
}

func TestRef(t *testing.T) {
	for image, want := range map[string]string{
		ControlPlane:   "docker.io/agentbox/agentbox-controlplane:dev",
		Sandbox:        "docker.io/agentbox/agentbox-sandbox:dev",
		EgressProxy:    "docker.io/agentbox/agentbox-egress-proxy:dev",
		Supervisor:     "docker.io/agentbox/agentbox-supervisor:dev",
		SandboxMinimal: "docker.io/agentbox/agentbox-sandbox-minimal:dev",
	} {
		got, err := Ref(image, "dev")
		if err != nil || got != want {
			t.Errorf("Ref(%s) = %q, %v; want %q", image, got, err, want)
		}
	}
	if _, err := Ref(Sandbox, "bad tag"); err == nil {
		t.Error("invalid tag accepted")
	}
}

func TestSkipPath(t *testing.T) {
	for name, want := range map[string]bool{
		"usr/share/doc/libc6/copyright":            false,
		"usr/share/doc/libc6":                      false,
		"usr/share/doc/libc6/changelog.Debian.gz":  true,
		"usr/share/man/man1/python3.1.gz":          true,
		"usr/share/locale/de/LC_MESSAGES/libc.mo":  true,
		"usr/lib/x86_64-linux-gnu/gconv/UTF-7.so":  true,
		"usr/lib/x86_64-linux-gnu/libc.so.6":       false,
		"usr/lib/python3.11/encodings/__init__.py": false,
		"usr/share/localedata/whatever":            false,
	} {
		if got := skipPath(name); got != want {
			t.Errorf("skipPath(%q) = %v, want %v", name, got, want)
		}
	}
	for name, want := range map[string]string{
		"bin/dash":                       "usr/bin/dash",
		"lib64/ld-linux-x86-64.so.2":     "usr/lib64/ld-linux-x86-64.so.2",
		"lib/x86_64-linux-gnu/libc.so.6": "usr/lib/x86_64-linux-gnu/libc.so.6",
		"libexec/x":                      "libexec/x",
		"etc/passwd":                     "etc/passwd",
	} {
		if got := usrPath(name); got != want {
			t.Errorf("usrPath(%q) = %q, want %q", name, got, want)
		}
	}
}
