package imagebuild

import (
	"archive/tar"
	"context"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	securejoin "github.com/cyphar/filepath-securejoin"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"golang.org/x/sys/unix"
)

// builtImage is an archive read back: its index name, config, and its
// layer unpacked into a folder.
type builtImage struct {
	name   string
	config v1.Config
	root   string
	// entries are the layer's headers by path.
	entries map[string]*tar.Header
}

// readArchive reads an OCI archive Build wrote and unpacks its single
// layer into a folder, as a runtime would, owners and modes included.
func readArchive(t *testing.T, archive string) *builtImage {
	t.Helper()
	dir := t.TempDir()
	untar(t, archive, dir)
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil || len(im.Manifests) != 1 {
		t.Fatalf("index: %+v, %v", im, err)
	}
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	b := &builtImage{name: im.Manifests[0].Annotations["io.containerd.image.name"], config: cf.Config,
		root: t.TempDir(), entries: map[string]*tar.Header{}}
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		name := strings.TrimSuffix(h.Name, "/")
		b.entries[name] = h
		p := filepath.Join(b.root, filepath.FromSlash(name))
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(p, 0o755)
		case tar.TypeReg:
			var f *os.File
			if f, err = os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600); err == nil {
				_, err = io.Copy(f, tr)
				f.Close()
			}
		case tar.TypeSymlink:
			err = os.Symlink(h.Linkname, p)
		case tar.TypeLink:
			err = os.Link(filepath.Join(b.root, filepath.FromSlash(h.Linkname)), p)
		default:
			t.Fatalf("%s: entry type %q in a layer", name, h.Typeflag)
		}
		if err == nil && h.Typeflag != tar.TypeSymlink && h.Typeflag != tar.TypeLink {
			if err = os.Chmod(p, entryMode(h.Mode)); err == nil {
				err = os.Lchown(p, h.Uid, h.Gid)
			}
		}
		if err != nil {
			t.Fatalf("unpacking %s: %v", name, err)
		}
	}
	return b
}

// run runs args in a chroot of the image.
func (b *builtImage) run(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command("chroot", append([]string{b.root}, args...)...)
	cmd.Env = b.config.Env
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("%s in the image: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

func (b *builtImage) file(t *testing.T, p string) string {
	t.Helper()
	c, err := os.ReadFile(filepath.Join(b.root, p))
	if err != nil {
		t.Fatal(err)
	}
	return string(c)
}

// noSupervisor fails when anything of the supervisor is in the image: the
// platform injects it.
func (b *builtImage) noSupervisor(t *testing.T) {
	t.Helper()
	for name := range b.entries {
		if strings.Contains(name, "agentbox") {
			t.Errorf("%s: the image holds %s", b.name, name)
		}
	}
	for _, e := range b.config.Env {
		if strings.HasPrefix(e, "GODEBUG=") {
			t.Errorf("%s: the image's env has %s", b.name, e)
		}
	}
}

func buildSpecs(t *testing.T, files ...string) map[string]Result {
	t.Helper()
	var specs []*Spec
	for _, f := range files {
		s, err := LoadSpec(f)
		if err != nil {
			t.Fatal(err)
		}
		specs = append(specs, s)
	}
	var log strings.Builder
	res, err := Build(context.Background(), Options{OutDir: t.TempDir(), Tag: "test", Specs: specs, Out: &log})
	t.Log(log.String())
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]Result{}
	for _, r := range res {
		byName[r.Image] = r
	}
	return byName
}

// TestForeignImages builds the test images that look like public ones,
// not like ours: the users, entrypoints and commands of their own, no
// sandbox user, no /workspace, no supervisor.
func TestForeignImages(t *testing.T) {
	requireAptAndRoot(t)
	files, err := filepath.Glob("testdata/foreign/test-*.json")
	if err != nil || len(files) != 3 {
		t.Fatalf("foreign specs %v, %v", files, err)
	}
	results := buildSpecs(t, files...)

	images := map[string]*builtImage{}
	for _, name := range []string{"debian-python", "node", "busybox"} {
		r, ok := results["test-"+name]
		if !ok {
			t.Fatalf("test-%s not built: %v", name, results)
		}
		if filepath.Base(r.Archive) != "test-"+name+".tar" || r.Ref != "docker.io/agentbox-test/"+name+":test" || r.Cached {
			t.Errorf("%s: %+v", name, r)
		}
		b := readArchive(t, r.Archive)
		images[name] = b
		if b.name != r.Ref {
			t.Errorf("%s: archive names %q", name, b.name)
		}
		c := b.config
		wantUser := "" // root's
		if name == "node" {
			wantUser = "1000:1000"
		}
		if c.User != wantUser || c.WorkingDir != "" || !strings.HasPrefix(c.Env[0], "PATH=") {
			t.Errorf("%s: user %q, working dir %q, env %v: want %q, none, PATH first", name, c.User, c.WorkingDir, c.Env, wantUser)
		}
		for _, e := range c.Env {
			if strings.HasPrefix(e, "HOME=") {
				t.Errorf("%s: env %s", name, e)
			}
		}
		if _, ok := b.entries["workspace"]; ok {
			t.Errorf("%s has a /workspace", name)
		}
		if h := b.entries["tmp"]; h == nil || h.Mode != 0o1777 {
			t.Errorf("%s: /tmp %+v, want mode 1777", name, h)
		}
		if passwd := b.file(t, "etc/passwd"); strings.Contains(passwd, "65532") || !strings.HasPrefix(passwd, "root:x:0:0:") {
			t.Errorf("%s: passwd\n%s", name, passwd)
		}
		if _, ok := b.entries["etc/ssl/certs/ca-certificates.crt"]; ok {
			t.Errorf("%s has the host's CA bundle; only a sandbox base adds it", name)
		}
		b.noSupervisor(t)
	}

	py := images["debian-python"]
	if !slices.Equal(py.config.Cmd, []string{"python3"}) || py.config.Entrypoint != nil {
		t.Errorf("debian-python: entrypoint %q cmd %q", py.config.Entrypoint, py.config.Cmd)
	}
	if out := py.run(t, "python3", "-c", "import json, sys; print(sys.version_info[0])"); out != "3" {
		t.Errorf("python3 in debian-python: %q", out)
	}
	if results["test-debian-python"].Python == "" {
		t.Error("debian-python: no Python version reported")
	}

	node := images["node"]
	if !slices.Equal(node.config.Entrypoint, []string{"docker-entrypoint.sh"}) || !slices.Equal(node.config.Cmd, []string{"node"}) {
		t.Errorf("node: entrypoint %q cmd %q", node.config.Entrypoint, node.config.Cmd)
	}
	if h := node.entries["usr/local/bin/docker-entrypoint.sh"]; h == nil || h.Mode != 0o755 {
		t.Errorf("node's entrypoint: %+v", h)
	}
	// As a runtime starts it: the entrypoint, found on PATH, given an
	// option passes it to node.
	if out := node.run(t, "/bin/sh", "-c", `exec docker-entrypoint.sh -e "console.log(6 * 7)"`); out != "42" {
		t.Errorf("node through its entrypoint: %q", out)
	}
	if !strings.Contains(node.file(t, "etc/passwd"), "node:x:1000:1000:") {
		t.Error("node: no node user")
	}

	bb := images["busybox"]
	if !slices.Equal(bb.config.Cmd, []string{"sh"}) || bb.config.Entrypoint != nil {
		t.Errorf("busybox: entrypoint %q cmd %q", bb.config.Entrypoint, bb.config.Cmd)
	}
	busybox, err := os.Stat(filepath.Join(bb.root, "usr/bin/busybox"))
	if err != nil {
		t.Fatal(err)
	}
	applets := strings.Fields(bb.run(t, "busybox", "--list"))
	spec, err := LoadSpec("testdata/foreign/test-busybox.json")
	if err != nil {
		t.Fatal(err)
	}
	for link := range spec.Links {
		// Each link resolves, inside the image, to busybox, which has
		// the applet.
		p, err := securejoin.SecureJoin(bb.root, link)
		if err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(p)
		if err != nil || !os.SameFile(fi, busybox) {
			t.Errorf("%s does not resolve to busybox: %v", link, err)
		}
		if !slices.Contains(applets, path.Base(link)) {
			t.Errorf("busybox has no applet %s", path.Base(link))
		}
	}
	if len(spec.Links) < 21 {
		t.Errorf("busybox links: %d", len(spec.Links))
	}
	script := `set -e; mkdir -p /tmp/d; echo a > /tmp/d/f; cp /tmp/d/f /tmp/d/g; mv /tmp/d/g /tmp/d/h
		cat /tmp/d/h | grep a | sed s/a/b/ | awk '{ print "got " $1 }'
		find /tmp/d -name h; tar -cf /tmp/t.tar -C /tmp d; head -n 1 /tmp/d/f; tail -n 1 /tmp/d/f; wc -l < /tmp/d/f
		id -u; env | grep -c '^PATH='; test -f /tmp/d/h; [ -d /tmp/d ]; sleep 0; rm -r /tmp/d /tmp/t.tar; ls /usr/bin/busybox`
	want := "got b\n/tmp/d/h\na\na\n1\n0\n1\n/usr/bin/busybox"
	if out := bb.run(t, "/bin/sh", "-c", script); out != want {
		t.Errorf("busybox applets through the links printed\n%s\nwant\n%s", out, want)
	}
	var pkgs []string
	for _, p := range results["test-busybox"].Packages {
		name, _, _ := strings.Cut(p, "=")
		pkgs = append(pkgs, name)
	}
	if want := []string{"busybox", "gcc-12-base", "libc6", "libgcc-s1"}; !slices.Equal(pkgs, want) {
		t.Errorf("busybox's packages %v, want %v", pkgs, want)
	}
}

// TestCustomSpecExample builds examples/images/custom-sandbox.json, the
// standard sandbox with a team's packages, file, link and environment.
func TestCustomSpecExample(t *testing.T) {
	requireAptAndRoot(t)
	const example = "../../examples/images/custom-sandbox.json"
	r := buildSpecs(t, example)["custom-sandbox"]
	// The spec's ref has its own tag: the build's does not replace it.
	if r.Ref != "example.com/team/sandbox:1" || filepath.Base(r.Archive) != "custom-sandbox.tar" || !strings.HasPrefix(r.Python, "3.") {
		t.Fatalf("result %+v", r)
	}
	for _, p := range []string{"ripgrep=", "fd-find=", "sqlite3=", "git=", "build-essential="} {
		if !slices.ContainsFunc(r.Packages, func(s string) bool { return strings.HasPrefix(s, p) }) {
			t.Errorf("packages lack %s", p)
		}
	}
	b := readArchive(t, r.Archive)
	b.noSupervisor(t)
	c := b.config
	if c.User != "65532:65532" || c.WorkingDir != "/workspace" || !slices.Equal(c.Cmd, []string{"/bin/bash"}) || c.Entrypoint != nil {
		t.Errorf("config: user %q dir %q cmd %q entrypoint %q: want the standard base's", c.User, c.WorkingDir, c.Cmd, c.Entrypoint)
	}
	for _, e := range []string{"HOME=/workspace", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1", "GIT_EDITOR=true", "PIP_DISABLE_PIP_VERSION_CHECK=1"} {
		if !slices.Contains(c.Env, e) {
			t.Errorf("env %v lacks %s", c.Env, e)
		}
	}
	want, err := os.ReadFile("../../examples/images/gitconfig")
	if err != nil {
		t.Fatal(err)
	}
	if got := b.file(t, "etc/gitconfig"); got != string(want) {
		t.Errorf("/etc/gitconfig:\n%s", got)
	}
	if h := b.entries["usr/local/bin/fd"]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "/usr/bin/fdfind" {
		t.Errorf("fd link: %+v", h)
	}
	if h := b.entries["workspace"]; h == nil || h.Uid != NonRootUID {
		t.Errorf("/workspace: %+v", h)
	}
	if !strings.Contains(b.file(t, "etc/passwd"), "sandbox:x:65532:65532:sandbox:/workspace:") {
		t.Error("no sandbox user")
	}

	// As the sandbox user, in the image as unpacked from the archive:
	// the team's tools, its git config, and the standard ones. git opens
	// /dev/null, which a runtime provides.
	null := filepath.Join(b.root, "dev/null")
	if err := unix.Mknod(null, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(null, 0o666); err != nil {
		t.Fatal(err)
	}
	asUser := func(script string) string {
		t.Helper()
		cmd := exec.Command("chroot", "--userspec=65532:65532", b.root, "/bin/bash", "-c", script)
		cmd.Env = c.Env
		cmd.Dir = "/"
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("%s: %v\n%s", script, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	if out := asUser(`cd /workspace && rg --version | head -n 1 && fd --version && sqlite3 --version | cut -d' ' -f1 && git config --system init.defaultBranch`); !strings.Contains(out, "ripgrep ") ||
		!strings.Contains(out, "fdfind ") || !strings.HasSuffix(out, "\nmain") {
		t.Errorf("the team's tools:\n%s", out)
	}
	// cc and awk are links to alternatives no maintainer script made.
	if out := asUser(`cd /tmp && printf 'int main(void){return 7;}' > t.c && cc -o t t.c; ./t; echo "exit $?" | awk '{ print $2 }'; rm -f t t.c`); out != "7" {
		t.Errorf("cc and awk: %q", out)
	}
	fi, err := os.Stat(filepath.Join(b.root, "workspace"))
	if err != nil || fi.Sys().(*syscall.Stat_t).Uid != NonRootUID {
		t.Errorf("/workspace unpacked: %v", err)
	}

	t.Run("apt in an image built FROM it", func(t *testing.T) { aptFromImage(t, b) })
}

// aptFromImage does, as root in the image, what a Dockerfile's `RUN
// apt-get install` does, without the network: apt, with the host's package
// lists, plans to install a package and nothing it already has; dpkg
// installs it beside the unpacked ones.
func aptFromImage(t *testing.T, b *builtImage) {
	asRoot := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("chroot", append([]string{b.root}, args...)...)
		cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "DEBIAN_FRONTEND=noninteractive"}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	if out := asRoot("dpkg-query", "-W", "-f", "${Package} ${Status}\n", "git", "libc6", "python3"); strings.Count(out, "install ok installed") != 3 {
		t.Errorf("dpkg's database:\n%s", out)
	}
	// No warning either: every package has its file list.
	if out := asRoot("dpkg", "-S", "/usr/bin/git"); out != "git: /usr/bin/git\n" {
		t.Errorf("dpkg -S /usr/bin/git: %s", out)
	}
	if !strings.Contains(b.file(t, "etc/apt/sources.list.d/debian.sources"), "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg") {
		t.Error("no Debian sources for apt")
	}

	lists, err := filepath.Glob("/var/lib/apt/lists/*Release")
	if err != nil || len(lists) == 0 {
		t.Skip("skipping apt: the host has no package lists")
	}
	packages, _ := filepath.Glob("/var/lib/apt/lists/*_Packages*")
	for _, f := range append(lists, packages...) {
		if err := copyFile(f, filepath.Join(b.root, f), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// tree needs libc6 alone, which the image has.
	plan := asRoot("apt-get", "install", "-s", "--no-install-recommends", "tree")
	var inst []string
	for _, line := range strings.Split(plan, "\n") {
		if strings.HasPrefix(line, "Inst ") {
			inst = append(inst, strings.Fields(line)[1])
		}
	}
	if !slices.Equal(inst, []string{"tree"}) {
		t.Errorf("apt would install %v, want tree alone:\n%s", inst, plan)
	}

	d := &Debian{Packages: []string{"tree"}, Logf: t.Logf}
	pkgs, err := d.Resolve(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	debs, err := d.Fetch(context.Background(), pkgs[slices.IndexFunc(pkgs, func(p Package) bool { return p.Name == "tree" }):][:1])
	if err != nil {
		t.Fatal(err)
	}
	if err := copyFile(debs[0], filepath.Join(b.root, "tmp/tree.deb"), 0o644); err != nil {
		t.Fatal(err)
	}
	out := asRoot("dpkg", "-i", "/tmp/tree.deb")
	if strings.Contains(out, "warning") {
		t.Errorf("dpkg -i warned:\n%s", out)
	}
	if out := asRoot("tree", "--version"); !strings.HasPrefix(out, "tree v") {
		t.Errorf("tree --version: %s", out)
	}
	if out := asRoot("apt-get", "check", "-q"); strings.Contains(out, "E:") {
		t.Errorf("apt-get check after the install:\n%s", out)
	}
	// The package's manual went where the build's exclusions send it.
	if _, err := os.Stat(filepath.Join(b.root, "usr/share/man/man1/tree.1.gz")); err == nil {
		t.Error("dpkg installed a manual the image's exclusions leave out")
	}
}

// TestSpecBuildIsCached: a spec's image is written again only when its
// inputs change, here one of its host files.
func TestSpecBuildIsCached(t *testing.T) {
	requireAptAndRoot(t)
	dir := t.TempDir()
	for _, f := range []string{"test-busybox.json", "passwd", "group"} {
		b, err := os.ReadFile(filepath.Join("testdata/foreign", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out := t.TempDir()
	build := func() Result {
		t.Helper()
		s, err := LoadSpec(filepath.Join(dir, "test-busybox.json"))
		if err != nil {
			t.Fatal(err)
		}
		var log strings.Builder
		res, err := Build(context.Background(), Options{OutDir: out, Tag: "test", Specs: []*Spec{s}, Out: &log})
		if err != nil || len(res) != 1 {
			t.Fatalf("%v, %v\n%s", res, err, log.String())
		}
		return res[0]
	}
	first, second := build(), build()
	if first.Cached || !second.Cached || first.Digest != second.Digest || second.RootSize != first.RootSize || second.RootSize == 0 {
		t.Fatalf("first %+v, second %+v", first, second)
	}
	if err := os.WriteFile(filepath.Join(dir, "group"), []byte("root:x:0:\nstaff:x:50:\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if third := build(); third.Cached || third.Digest == first.Digest {
		t.Errorf("after a file changed: %+v", third)
	}
}

// TestChecksFailABrokenImage: an image whose program cannot start fails
// its build.
func TestChecksFailABrokenImage(t *testing.T) {
	requireAptAndRoot(t)
	ctx := context.Background()
	d := &Debian{Packages: []string{"busybox"}, Logf: t.Logf}
	pkgs, err := d.Resolve(ctx)
	if err != nil {
		t.Fatal(err)
	}
	debs, err := d.Fetch(ctx, pkgs)
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	if err := Unpack(ctx, debs, root); err != nil {
		t.Fatal(err)
	}
	if _, err := CheckRootfs(ctx, root, []string{"busybox"}, t.Logf); err != nil {
		t.Fatalf("the intact image: %v", err)
	}
	libc, err := filepath.Glob(filepath.Join(root, "usr/lib/*/libc.so.6"))
	if err != nil || len(libc) != 1 {
		t.Fatalf("libc: %v %v", libc, err)
	}
	if err := os.Remove(libc[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := CheckRootfs(ctx, root, []string{"busybox"}, t.Logf); err == nil || !strings.Contains(err.Error(), "check of package busybox") {
		t.Errorf("busybox without libc passed its check: %v", err)
	}
	// The checks leave nothing behind.
	if left, _ := os.ReadDir(filepath.Join(root, "tmp")); len(left) != 0 {
		t.Errorf("/tmp after the checks: %v", left)
	}
	if _, err := os.Lstat(filepath.Join(root, "dev/null")); err == nil {
		t.Error("/dev/null left in the image")
	}
}

// TestSupervisorImage builds the image the platform's init container
// copies the supervisor out of: the static binary where the install
// command runs it, nothing that needs a libc.
func TestSupervisorImage(t *testing.T) {
	if _, err := os.Stat(HostCABundle); err != nil {
		t.Skipf("skipping: %s missing (apt-get install ca-certificates)", HostCABundle)
	}
	moduleDir, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	res, err := Build(context.Background(), Options{OutDir: t.TempDir(), Tag: "test", Only: []string{Supervisor}, ModuleDir: moduleDir, Out: &log})
	t.Log(log.String())
	if err != nil || len(res) != 1 {
		t.Fatalf("%+v, %v", res, err)
	}
	r := res[0]
	if filepath.Base(r.Archive) != "agentbox-supervisor.tar" || r.Ref != "docker.io/agentbox/agentbox-supervisor:test" {
		t.Errorf("result %+v", r)
	}
	b := readArchive(t, r.Archive)
	if h := b.entries["usr/local/bin/agentbox-supervisor"]; h == nil || h.Mode != 0o755 || h.Uid != 0 {
		t.Fatalf("the supervisor's binary: %+v", h)
	}
	if !slices.Equal(b.config.Entrypoint, []string{"/usr/local/bin/agentbox-supervisor"}) || b.config.User != "65532:65532" {
		t.Errorf("config %+v", b.config)
	}
	for name := range b.entries {
		if strings.HasPrefix(name, "usr/lib") || strings.HasPrefix(name, "lib") {
			t.Errorf("a static image holds %s", name)
		}
	}
	if os.Geteuid() != 0 {
		t.Log("not root: the binary is not run in a chroot of the image")
		return
	}
	// The image has no libc: the binary runs only if it is static. -h
	// prints its flags and exits.
	out, _ := exec.Command("chroot", b.root, "/usr/local/bin/agentbox-supervisor", "-h").CombinedOutput()
	if !strings.Contains(string(out), "-listen") {
		t.Errorf("agentbox-supervisor -h in its image:\n%s", out)
	}
}

// TestDebianImageIsReproducible builds an image with apt and dpkg twice:
// the same digest both times, so neither the database the build writes nor
// the checks (apt-get check would write its caches) add anything that
// differs between builds.
func TestDebianImageIsReproducible(t *testing.T) {
	requireAptAndRoot(t)
	s, err := ParseSpec([]byte(`{"ref": "agentbox-test/apt:1", "base": "none", "packages": ["apt", "dpkg"]}`))
	if err != nil {
		t.Fatal(err)
	}
	s.Name = "apt"
	var digests []string
	for range 2 {
		var log strings.Builder
		res, err := Build(context.Background(), Options{OutDir: t.TempDir(), Specs: []*Spec{s}, Out: &log})
		if err != nil || len(res) != 1 {
			t.Fatalf("%+v, %v\n%s", res, err, log.String())
		}
		if !strings.Contains(log.String(), " apt") {
			t.Errorf("apt's check did not run:\n%s", log.String())
		}
		digests = append(digests, res[0].Digest)
		b := readArchive(t, res[0].Archive)
		for name := range b.entries {
			if strings.HasPrefix(name, "var/cache/apt/") && strings.HasSuffix(name, ".bin") || strings.HasPrefix(name, "tmp/") {
				t.Errorf("the build left %s in the image", name)
			}
		}
		if _, ok := b.entries["var/lib/dpkg/info/format"]; !ok {
			t.Error("no dpkg database")
		}
	}
	if digests[0] != digests[1] {
		t.Errorf("two builds, two digests: %v", digests)
	}
}
