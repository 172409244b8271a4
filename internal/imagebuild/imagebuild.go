// Package imagebuild builds agentbox's container images as OCI archives,
// without Docker or a registry: the control plane and the egress proxy from
// their static binaries, the sandbox from Debian packages fetched with the
// host's apt plus the supervisor, and on request the chart's runsc installer
// from its binary plus the test toolchain's gVisor. `agentbox-images` is its
// command line.
//
// A build is skipped when its inputs have not changed (a stamp next to each
// archive records them), so a repeated run only compiles, resolves package
// versions and compares.
package imagebuild

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/distribution/reference"
	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/ociimage"
	"github.com/agentbox/terraform-provider-agentbox/internal/progress"
)

// Image names as -only takes them.
const (
	ControlPlane = "controlplane"
	Sandbox      = "sandbox"
	EgressProxy  = "egress-proxy"
	// RunscInstaller is the image of the chart's optional runsc installer
	// DaemonSet: its command plus runsc and containerd-shim-runsc-v1.
	RunscInstaller = "runsc-installer"
)

// All lists the images built by default, in build order.
var All = []string{ControlPlane, EgressProxy, Sandbox}

// OnRequest lists the images built only when Options.Only names them. The
// runsc installer is one: it needs gVisor built first (`make testenv`),
// which neither `make images` nor the quickstart otherwise needs, and only
// clusters whose nodes lack runsc use it.
var OnRequest = []string{RunscInstaller}

// RunscBinaries are the gVisor files of the runsc installer image, under
// RunscImageDir, taken from Options.RunscDir.
var RunscBinaries = []string{"runsc", "containerd-shim-runsc-v1"}

// RunscImageDir is where the runsc installer image holds RunscBinaries.
const RunscImageDir = "/opt/agentbox/runsc"

// DefaultSandboxPackages make the sandbox: python3 rather than
// python3-minimal, whose standard library lacks json and venv;
// python3-venv for ensurepip and the pip wheel it installs, without which
// the supervisor cannot build its cached virtual environments (Debian
// strips ensurepip from python3); coreutils because agents expect ls, cat
// and friends; dash for the /bin/sh that `sh -c` and Python's
// subprocess(shell=True) expect.
var DefaultSandboxPackages = []string{"python3", "python3-venv", "dash", "coreutils", "tar"}

// DefaultSandboxExclude leaves out dpkg: python3's packages depend on it
// for their maintainer scripts, which never run in an unpacked, read-only
// image. (tar, which dpkg needs, is listed in DefaultSandboxPackages for
// its own sake: agents archive files, and kubectl cp runs it.)
var DefaultSandboxExclude = []string{"dpkg"}

// spec is what differs between the images.
type spec struct {
	image  string // -only name
	repo   string // repository, without tag
	binary string // command built into the image
}

var specs = map[string]spec{
	ControlPlane:   {ControlPlane, "agentbox/agentbox-controlplane", "agentbox-controlplane"},
	EgressProxy:    {EgressProxy, "agentbox/agentbox-egress-proxy", "agentbox-egress-proxy"},
	Sandbox:        {Sandbox, "agentbox/agentbox-sandbox", "agentbox-supervisor"},
	RunscInstaller: {RunscInstaller, "agentbox/agentbox-runsc-installer", "agentbox-runsc-installer"},
}

func known() string { return strings.Join(append(slices.Clone(All), OnRequest...), ", ") }

// ArchiveName is the file an image is written to in the output folder.
func ArchiveName(image string) string { return "agentbox-" + image + ".tar" }

// Ref is the normalised reference of an image at tag, the name containerd
// stores and kubelet asks for (docker.io/agentbox/...:tag).
func Ref(image, tag string) (string, error) {
	s, ok := specs[image]
	if !ok {
		return "", fmt.Errorf("unknown image %q (known: %s)", image, known())
	}
	named, err := reference.ParseNormalizedNamed(s.repo + ":" + tag)
	if err != nil {
		return "", fmt.Errorf("image %s tag %q: %w", image, tag, err)
	}
	return named.String(), nil
}

// Options configures Build.
type Options struct {
	OutDir string
	Tag    string
	// Only restricts the build to these images; empty means All.
	Only []string
	// ModuleDir is the repository root the commands are built from;
	// default the current directory.
	ModuleDir string
	// Go is the go command; default "go".
	Go string
	// Sandbox overrides the Debian packages of the sandbox image; its zero
	// value means DefaultSandboxPackages and DefaultSandboxExclude.
	Sandbox Debian
	// CABundle defaults to HostCABundle.
	CABundle string
	// RunscDir holds the RunscBinaries of the runsc installer image (the
	// test toolchain's bin folder); only that image needs it.
	RunscDir string
	// Out receives progress lines; nil is quiet.
	Out io.Writer
}

// Result describes one image after Build.
type Result struct {
	Image, Ref, Archive string
	Digest              string
	Size                int64
	Cached              bool
	Python              string // sandbox only
	Packages            []string
}

// stamp is stored next to each archive. Inputs is the hash that decides
// whether to rebuild; the rest is what a cached run reports.
type stamp struct {
	Inputs   string   `json:"inputs"`
	Ref      string   `json:"ref"`
	Digest   string   `json:"digest"`
	Size     int64    `json:"size"`
	Python   string   `json:"python,omitempty"`
	Packages []string `json:"packages,omitempty"`
}

func stampPath(outDir, image string) string {
	return filepath.Join(outDir, "."+ArchiveName(image)+".stamp")
}

// Build builds the images into o.OutDir. Images are independent: a failure
// is reported and the others are still built.
func Build(ctx context.Context, o Options) ([]Result, error) {
	start := time.Now()
	if o.OutDir == "" || o.Tag == "" {
		return nil, errors.New("output folder and tag are required")
	}
	only := o.Only
	if len(only) == 0 {
		only = All
	}
	for _, im := range only {
		if _, ok := specs[im]; !ok {
			return nil, fmt.Errorf("unknown image %q (known: %s)", im, known())
		}
	}
	if o.Go == "" {
		o.Go = "go"
	}
	if o.CABundle == "" {
		o.CABundle = HostCABundle
	}
	if len(o.Sandbox.Packages) == 0 {
		o.Sandbox.Packages = DefaultSandboxPackages
		if o.Sandbox.Exclude == nil {
			o.Sandbox.Exclude = DefaultSandboxExclude
		}
	}
	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return nil, err
	}
	builder, err := selfHash()
	if err != nil {
		return nil, err
	}

	var results []Result
	var errs []error
	for _, im := range append(slices.Clone(All), OnRequest...) {
		if !slices.Contains(only, im) {
			continue
		}
		r, err := buildOne(ctx, o, specs[im], builder)
		if err != nil {
			o.logf("%s: FAILED: %v", ArchiveName(im), err)
			errs = append(errs, fmt.Errorf("%s: %w", im, err))
			continue
		}
		results = append(results, r)
	}
	o.logf("images: %d built or up to date, %d failed, in %s", len(results), len(errs), since(start))
	return results, errors.Join(errs...)
}

func (o *Options) logf(format string, args ...any) {
	if o.Out != nil {
		fmt.Fprintf(o.Out, format+"\n", args...)
	}
}

func since(t time.Time) string { return time.Since(t).Round(10 * time.Millisecond).String() }

// buildOne builds one image, or finds it up to date: the archive is
// rewritten only when an input changed.
func buildOne(ctx context.Context, o Options, s spec, builder string) (Result, error) {
	start := time.Now()
	name := ArchiveName(s.image)
	ref, err := Ref(s.image, o.Tag)
	if err != nil {
		return Result{}, err
	}
	res := Result{Image: s.image, Ref: ref, Archive: filepath.Join(o.OutDir, name)}

	t := time.Now()
	bin := filepath.Join(o.OutDir, ".bin", s.binary)
	if err := goBuild(ctx, o, s.binary, bin); err != nil {
		return res, err
	}
	o.logf("%s: go build %s: %s", name, s.binary, since(t))

	in, err := collectInputs(ctx, o, s, builder, ref, bin)
	if err != nil {
		return res, err
	}
	res.Packages = in.packages

	if st, ok := readStamp(o.OutDir, s.image); ok && st.Inputs == in.hash && archiveMatches(res.Archive, st.Size) {
		res.Cached, res.Digest, res.Size, res.Python = true, st.Digest, st.Size, st.Python
		o.logf("%s: up to date: %s %s (%s)%s", name, ref, mb(st.Size), shortDigest(st.Digest), pythonNote(st.Python))
		return res, nil
	}

	t = time.Now()
	if err := writeImage(ctx, o, s, bin, in, &res); err != nil {
		return res, err
	}
	o.logf("%s: wrote %s %s (%s)%s: %s (total %s)", name, ref, mb(res.Size), shortDigest(res.Digest), pythonNote(res.Python), since(t), since(start))
	return res, nil
}

// imageInputs is what an image is made of, and the hash of it that
// decides whether the archive must be written again.
type imageInputs struct {
	hash string
	// extra are the files beside the binary (the runsc installer's).
	extra []ExtraFile
	// pkgs are the sandbox's Debian packages, and packages their summary.
	pkgs     []Package
	packages []string
}

// collectInputs gathers the inputs: what the image is made of, and the
// builder itself, whose code decides the layout (hashing it spares a
// version number someone has to remember to bump).
func collectInputs(ctx context.Context, o Options, s spec, builder, ref, bin string) (*imageInputs, error) {
	name := ArchiveName(s.image)
	in := &imageInputs{}
	inputs := []string{"builder " + builder, "ref " + ref}
	hashed := []string{bin, o.CABundle}
	if s.image == RunscInstaller {
		files, extra, err := runscFiles(o.RunscDir)
		if err != nil {
			return nil, err
		}
		hashed = append(hashed, files...)
		in.extra = extra
	}
	for _, f := range hashed {
		h, err := fileHash(f)
		if err != nil {
			return nil, err
		}
		inputs = append(inputs, "file "+filepath.Base(f)+" "+h)
	}
	if s.image == Sandbox {
		t := time.Now()
		d := o.Sandbox
		d.Logf = func(f string, a ...any) { o.logf(name+": "+f, a...) }
		pkgs, err := d.Resolve(ctx)
		if err != nil {
			return nil, err
		}
		in.pkgs, in.packages = pkgs, PackageSummary(pkgs)
		inputs = append(inputs, "packages "+strings.Join(in.packages, " "))
		o.logf("%s: %d Debian packages resolved with apt-cache: %s", name, len(pkgs), since(t))
	}
	sum := sha256.Sum256([]byte(strings.Join(inputs, "\n")))
	in.hash = hex.EncodeToString(sum[:])
	return in, nil
}

// runscFiles are the gVisor binaries the runsc installer image carries:
// their paths on this machine and where they go in the image.
func runscFiles(runscDir string) ([]string, []ExtraFile, error) {
	if runscDir == "" {
		return nil, nil, errors.New("no folder with runsc and containerd-shim-runsc-v1 given (agentbox-images -runsc-dir)")
	}
	var files []string
	var extra []ExtraFile
	for _, b := range RunscBinaries {
		p := filepath.Join(runscDir, b)
		if _, err := os.Stat(p); err != nil {
			return nil, nil, fmt.Errorf("%s is needed for the runsc installer image; build it with `make testenv`: %w", p, err)
		}
		files = append(files, p)
		extra = append(extra, ExtraFile{Path: path.Join(RunscImageDir, b), From: p})
	}
	return files, extra, nil
}

// writeImage writes the archive and the stamp that records its inputs,
// filling in res's digest, size and Python version.
func writeImage(ctx context.Context, o Options, s spec, bin string, in *imageInputs, res *Result) error {
	name := ArchiveName(s.image)
	labels := map[string]string{
		"org.opencontainers.image.title":   "agentbox-" + s.image,
		"org.opencontainers.image.version": o.Tag,
	}
	var digest v1.Hash
	var err error
	if s.image == Sandbox {
		logf := func(f string, a ...any) { o.logf(name+": "+f, a...) }
		d := o.Sandbox
		d.Logf = logf
		digest, res.Python, err = writeSandbox(ctx, &d, in.pkgs, res.Ref, bin, o.CABundle, res.Archive, labels, logf)
	} else {
		digest, err = StaticImage{Ref: res.Ref, Name: s.binary, Binary: bin, CABundle: o.CABundle, Labels: labels, Extra: in.extra}.Write(res.Archive)
	}
	if err != nil {
		return err
	}
	fi, err := os.Stat(res.Archive)
	if err != nil {
		return err
	}
	res.Digest, res.Size = digest.String(), fi.Size()
	return writeStamp(o.OutDir, s.image, stamp{Inputs: in.hash, Ref: res.Ref, Digest: res.Digest, Size: res.Size, Python: res.Python, Packages: res.Packages})
}

func writeSandbox(ctx context.Context, d *Debian, pkgs []Package, ref, supervisor, ca, out string, labels map[string]string, logf func(string, ...any)) (digest v1.Hash, python string, err error) {
	t := time.Now()
	debs, err := d.Fetch(ctx, pkgs)
	if err != nil {
		return v1.Hash{}, "", err
	}
	logf("packages in the cache (%s): %s", d.cacheDirOrDefault(), since(t))
	dir, err := os.MkdirTemp(filepath.Dir(out), ".rootfs-sandbox-")
	if err != nil {
		return v1.Hash{}, "", err
	}
	defer os.RemoveAll(dir)
	t = time.Now()
	step := progress.Start(logf, "root filesystem", fmt.Sprintf("unpacking %d packages", len(debs)), 0)
	err = Unpack(ctx, debs, dir)
	step.Stop()
	if err != nil {
		return v1.Hash{}, "", err
	}
	if err := SandboxFiles(dir, supervisor, ca); err != nil {
		return v1.Hash{}, "", err
	}
	size, err := dirSize(dir)
	if err != nil {
		return v1.Hash{}, "", err
	}
	logf("root filesystem unpacked (%s uncompressed): %s", mb(size), since(t))
	if os.Geteuid() == 0 {
		if python, err = PythonVersion(ctx, dir); err != nil {
			return v1.Hash{}, "", err
		}
	} else {
		python = pythonFromPackages(pkgs)
		logf("not root: Python not run in a chroot; version from its package")
	}
	// Compressing a few hundred megabytes takes a while on a small machine.
	step = progress.Start(logf, "image archive", "writing and compressing the layer", 0)
	defer step.Stop()
	h, err := ociimage.WriteArchive(ociimage.Image{
		Ref:        ref,
		Rootfs:     dir,
		Entrypoint: []string{"/usr/local/bin/agentbox-supervisor"},
		Env: []string{
			ociimage.DefaultPath,
			"HOME=/workspace",
			"LANG=C.UTF-8",
			// The root file system is read-only; Python would try and
			// fail to write __pycache__ next to every module it imports.
			"PYTHONDONTWRITEBYTECODE=1",
			supervisorGODEBUG,
		},
		WorkingDir: "/workspace",
		User:       fmt.Sprintf("%d:%d", NonRootUID, NonRootUID),
		Labels:     labels,
	}, out)
	return h, python, err
}

// supervisorGODEBUG is the Go runtime setting the sandbox image gives the
// supervisor (commands do not inherit it: they get a minimal environment).
// The supervisor links no memory profiler, so the runtime turns memory
// profiling off at start, but still records the one allocation it samples
// while doing so, and that sample allocates the profiler's 1.4 MiB hash
// table. Under gVisor the table, touched in scattered places, counts
// whole in the pod's RSS. With no profile stacks there is no sample to
// record (runtime.mProf_Malloc returns first) and no table. No profile is
// ever read from the supervisor, so nothing else changes.
const supervisorGODEBUG = "GODEBUG=profstackdepth=0"

func (d *Debian) cacheDirOrDefault() string {
	if d.CacheDir != "" {
		return d.CacheDir
	}
	c, _ := DefaultDebCache()
	return c
}

// pythonFromPackages reads the upstream version off python3.X-minimal,
// e.g. "3.11.2" from 3.11.2-6+deb12u9.
func pythonFromPackages(pkgs []Package) string {
	for _, p := range pkgs {
		if strings.HasPrefix(p.Name, "python3.") && strings.HasSuffix(p.Name, "-minimal") {
			v, _, _ := strings.Cut(p.Version, "-")
			if _, after, ok := strings.Cut(v, ":"); ok {
				v = after
			}
			return v
		}
	}
	return ""
}

func goBuild(ctx context.Context, o Options, command, out string) error {
	moduleDir := o.ModuleDir
	if moduleDir == "" {
		moduleDir = "."
	}
	pkgDir := filepath.Join(moduleDir, "internal", "cmd", command)
	if _, err := os.Stat(filepath.Join(pkgDir, "main.go")); err != nil {
		return fmt.Errorf("%s has no main.go yet: %w", pkgDir, err)
	}
	// Built into a lasting path: go build leaves a binary alone when its
	// build ID says it is current, so an unchanged command is not linked
	// again. Static binaries: the control plane and proxy images hold no
	// libc, and the supervisor must not depend on the sandbox's.
	c := progress.Cmd{Dir: moduleDir, Env: append(os.Environ(), "CGO_ENABLED=0"), Logf: o.logf, Label: "go build " + command}
	return c.GoBuild(ctx, progress.GoBuild{Go: o.Go, Flags: []string{"-trimpath", "-ldflags", "-s -w -X main.version=" + o.Tag},
		Out: out, Packages: []string{"./internal/cmd/" + command}})
}

func selfHash() (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("locating this program to fingerprint it: %w", err)
	}
	return fileHash(exe)
}

func fileHash(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func readStamp(outDir, image string) (stamp, bool) {
	var st stamp
	b, err := os.ReadFile(stampPath(outDir, image))
	if err != nil || json.Unmarshal(b, &st) != nil {
		return stamp{}, false
	}
	return st, true
}

func writeStamp(outDir, image string, st stamp) error {
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(stampPath(outDir, image), append(b, '\n'), 0o644)
}

// archiveMatches is a cheap check that the archive is the one the stamp
// describes and was not replaced or truncated since.
func archiveMatches(p string, size int64) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Size() == size
}

func dirSize(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(_ string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			n += fi.Size()
		}
		return nil
	})
	return n, err
}

func mb(n int64) string { return fmt.Sprintf("%.1f MB", float64(n)/1e6) }

func shortDigest(d string) string {
	if len(d) > 19 {
		return d[:19]
	}
	return d
}

func pythonNote(v string) string {
	if v == "" {
		return ""
	}
	return ", Python " + v
}
