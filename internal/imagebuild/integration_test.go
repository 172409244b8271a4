package imagebuild

import (
	"archive/tar"
	"context"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/agentbox/terraform-provider-agentbox/internal/ociimage"
)

// tinyBinary builds a small static program standing in for a real command.
func tinyBinary(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go not on PATH")
	}
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "go.mod"), []byte("module tiny\n\ngo 1.22\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "main.go"), []byte("package main\n\nfunc main() { println(\"tiny\") }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "tiny")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", bin, ".")
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=mod", "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// requireAptAndRoot skips unless the sandbox can be built for real: apt
// with package lists, and root for chroot.
func requireAptAndRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: building and chroot-ing into the sandbox root filesystem needs root")
	}
	for _, tool := range []string{"apt-cache", "apt-get", "dpkg-deb", "chroot"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: %s not found; the sandbox image is built from Debian packages with apt", tool)
		}
	}
	if out, err := exec.Command("apt-cache", "show", "--no-all-versions", "python3-minimal").CombinedOutput(); err != nil || !strings.Contains(string(out), "Filename:") {
		t.Skipf("skipping: apt knows no downloadable python3-minimal (run apt-get update): %v %s", err, out)
	}
}

func TestStaticImageArchive(t *testing.T) {
	if _, err := os.Stat(HostCABundle); err != nil {
		t.Skipf("skipping: %s missing (apt-get install ca-certificates)", HostCABundle)
	}
	bin := tinyBinary(t)
	ref, err := Ref(ControlPlane, "test")
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), ArchiveName(ControlPlane))
	digest, err := StaticImage{Ref: ref, Name: "agentbox-controlplane", Binary: bin}.Write(out)
	if err != nil {
		t.Fatal(err)
	}

	// The archive is an OCI layout in a tar; go-containerregistry reads
	// the layout from a folder.
	dir := t.TempDir()
	untar(t, out, dir)
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 || im.Manifests[0].Digest != digest ||
		im.Manifests[0].Annotations[ociimage.AnnotationImageName] != "docker.io/agentbox/agentbox-controlplane:test" {
		t.Fatalf("index: %+v", im.Manifests)
	}
	img, err := idx.Image(digest)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.Config.User != "65532:65532" || !slices.Equal(cf.Config.Entrypoint, []string{"/usr/local/bin/agentbox-controlplane"}) {
		t.Errorf("config: user %q entrypoint %q", cf.Config.User, cf.Config.Entrypoint)
	}

	files := map[string]*tar.Header{}
	var passwd string
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
		files[strings.TrimSuffix(h.Name, "/")] = h
		if h.Name == "etc/passwd" {
			b, _ := io.ReadAll(tr)
			passwd = string(b)
		}
	}
	want := map[string]int64{
		"usr/local/bin/agentbox-controlplane": 0o755,
		"etc/ssl/certs/ca-certificates.crt":   0o644,
		"etc/passwd":                          0o644,
		"etc/group":                           0o644,
		"tmp":                                 0o1777,
	}
	for name, mode := range want {
		h, ok := files[name]
		if !ok {
			t.Errorf("%s missing from the layer", name)
			continue
		}
		if h.Mode != mode || h.Uid != 0 {
			t.Errorf("%s: mode %o uid %d, want %o uid 0", name, h.Mode, h.Uid, mode)
		}
	}
	if !strings.Contains(passwd, "nonroot:x:65532:65532:") {
		t.Errorf("passwd has no nonroot user 65532:\n%s", passwd)
	}
	if len(files) > 16 {
		t.Errorf("a static image should hold a handful of files, got %d", len(files))
	}
}

// TestSandboxRootfs builds the sandbox's root filesystem alone, from the
// Debian packages apt resolves on this machine, and runs its Python.
func TestSandboxRootfs(t *testing.T) {
	requireAptAndRoot(t)
	ctx := context.Background()
	plan := MinimalSpec("unused").resolve()
	d := &Debian{Packages: plan.packages, Exclude: plan.exclude, Logf: t.Logf}
	pkgs, err := d.Resolve(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("packages: %v", PackageSummary(pkgs))
	debs, err := d.Fetch(ctx, pkgs)
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	if err := Unpack(ctx, debs, root); err != nil {
		t.Fatal(err)
	}
	if err := SandboxFiles(root, ""); err != nil {
		t.Fatal(err)
	}

	out, err := exec.Command("chroot", root, "/usr/bin/python3", "-c", "import platform; print(platform.python_version())").CombinedOutput()
	if err != nil {
		t.Fatalf("chroot python3: %v\n%s", err, out)
	}
	version := strings.TrimSpace(string(out))
	if !strings.HasPrefix(version, "3.") {
		t.Fatalf("python version %q", version)
	}
	t.Logf("Python %s", version)
	if v, err := PythonVersion(ctx, root); err != nil || v != version {
		t.Errorf("PythonVersion (json, ssl, sqlite3 imported) = %q, %v", v, err)
	}
	if out, err := exec.Command("chroot", root, "/bin/sh", "-c", "echo sh works").CombinedOutput(); err != nil || strings.TrimSpace(string(out)) != "sh works" {
		t.Errorf("chroot /bin/sh: %v %s", err, out)
	}
	// As the sandbox user, Python's HTTPS defaults find the CA bundle.
	cmd := exec.Command("chroot", "--userspec=65532:65532", root, "/usr/bin/python3", "-c",
		"import ssl; ctx = ssl.create_default_context(); print(len(ctx.get_ca_certs()) > 0 or ctx.cert_store_stats()['x509_ca'] > 0)")
	if out, err := cmd.CombinedOutput(); err != nil || strings.TrimSpace(string(out)) != "True" {
		t.Errorf("python ssl CA bundle as user 65532: %v %s", err, out)
	}
	// The supervisor's environment cache needs venv with ensurepip, which
	// Debian ships apart from python3: its installer environment gets pip
	// this way.
	cmd = exec.Command("chroot", "--userspec=65532:65532", root, "/bin/sh", "-c",
		"/usr/bin/python3 -m venv /tmp/venv-check && /tmp/venv-check/bin/python -m pip --version")
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=/tmp", "LANG=C.UTF-8"}
	if out, err := cmd.CombinedOutput(); err != nil || !strings.HasPrefix(string(out), "pip ") {
		t.Errorf("python3 -m venv with pip as user 65532: %v %s", err, out)
	} else {
		t.Logf("venv as user 65532: %s", strings.TrimSpace(string(out)))
	}

	for _, link := range []string{"bin", "lib", "lib64", "sbin"} {
		if target, err := os.Readlink(filepath.Join(root, link)); err != nil || target != "usr/"+link {
			t.Errorf("/%s: %q, %v; want a merged-/usr symlink", link, target, err)
		}
	}
	for p, want := range map[string]fs.FileMode{"tmp": fs.ModeDir | fs.ModeSticky | 0o777, "workspace": fs.ModeDir | 0o755} {
		fi, err := os.Stat(filepath.Join(root, p))
		if err != nil || fi.Mode() != want {
			t.Errorf("/%s: %v %v, want %v", p, fi.Mode(), err, want)
			continue
		}
		if p == "workspace" && fi.Sys().(*syscall.Stat_t).Uid != NonRootUID {
			t.Errorf("/workspace not owned by %d", NonRootUID)
		}
	}
	if _, err := os.Stat(filepath.Join(root, "usr/share/doc/libc6/copyright")); err != nil {
		t.Errorf("copyright files must stay: %v", err)
	}
	if _, err := os.Stat(filepath.Join(root, "usr/bin/dpkg")); err == nil {
		t.Error("dpkg was excluded but is in the root filesystem")
	}
}

// TestBuildIsIdempotent builds the egress proxy image through Build twice:
// the second run must find its stamp and skip.
func TestBuildIsIdempotent(t *testing.T) {
	if _, err := os.Stat(HostCABundle); err != nil {
		t.Skipf("skipping: %s missing (apt-get install ca-certificates)", HostCABundle)
	}
	moduleDir, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	o := Options{OutDir: t.TempDir(), Tag: "test", Only: []string{EgressProxy}, ModuleDir: moduleDir, Out: &log}
	first, err := Build(context.Background(), o)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	second, err := Build(context.Background(), o)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	t.Log(log.String())
	if len(first) != 1 || first[0].Cached || len(second) != 1 || !second[0].Cached || first[0].Digest != second[0].Digest {
		t.Fatalf("first %+v, second %+v", first, second)
	}
	if first[0].Ref != "docker.io/agentbox/agentbox-egress-proxy:test" {
		t.Errorf("ref %q", first[0].Ref)
	}
	// A changed tag changes the binary's version and the name: rebuilt.
	o.Tag = "test2"
	third, err := Build(context.Background(), o)
	if err != nil || third[0].Cached {
		t.Fatalf("after a tag change: %+v, %v", third, err)
	}
}

func untar(t *testing.T, archive, dir string) {
	t.Helper()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}
