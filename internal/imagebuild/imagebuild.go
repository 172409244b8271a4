// Package imagebuild builds agentbox's container images as OCI archives,
// without Docker or a registry: the control plane, the egress proxy and the
// supervisor (which the platform copies into every sandbox pod) from their
// static binaries; the standard and minimal sandbox images, and any image a
// Spec describes, from Debian packages fetched with the host's apt; and on
// request the chart's runsc installer from its binary plus the test
// toolchain's gVisor. `agentbox-images` is its command line.
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
	"io/fs"
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
	EgressProxy  = "egress-proxy"
	// Supervisor holds the supervisor's static binary, which an init
	// container of every sandbox pod copies out (-install).
	Supervisor = "supervisor"
	// Sandbox is the standard sandbox image (StandardSpec).
	Sandbox = "sandbox"
	// SandboxMinimal is the minimal sandbox image (MinimalSpec).
	SandboxMinimal = "sandbox-minimal"
	// RunscInstaller is the image of the chart's optional runsc installer
	// DaemonSet: its command plus runsc and containerd-shim-runsc-v1.
	RunscInstaller = "runsc-installer"
)

// All lists the images built by default, in build order.
var All = []string{ControlPlane, EgressProxy, Supervisor, Sandbox, SandboxMinimal}

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

// builtin is what differs between the images -only names.
type builtin struct {
	repo string // repository, without tag
	// binary is the command a static image holds; spec makes a Debian
	// image instead.
	binary string
	spec   func(ref string) *Spec
}

var builtins = map[string]builtin{
	ControlPlane:   {repo: "agentbox/agentbox-controlplane", binary: "agentbox-controlplane"},
	EgressProxy:    {repo: "agentbox/agentbox-egress-proxy", binary: "agentbox-egress-proxy"},
	Supervisor:     {repo: "agentbox/agentbox-supervisor", binary: "agentbox-supervisor"},
	Sandbox:        {repo: "agentbox/agentbox-sandbox", spec: StandardSpec},
	SandboxMinimal: {repo: "agentbox/agentbox-sandbox-minimal", spec: MinimalSpec},
	RunscInstaller: {repo: "agentbox/agentbox-runsc-installer", binary: "agentbox-runsc-installer"},
}

func known() string { return strings.Join(append(slices.Clone(All), OnRequest...), ", ") }

// ArchiveName is the file an image is written to in the output folder.
func ArchiveName(image string) string { return "agentbox-" + image + ".tar" }

// Ref is the normalised reference of an image at tag, the name containerd
// stores and kubelet asks for (docker.io/agentbox/...:tag).
func Ref(image, tag string) (string, error) {
	b, ok := builtins[image]
	if !ok {
		return "", fmt.Errorf("unknown image %q (known: %s)", image, known())
	}
	named, err := reference.ParseNormalizedNamed(b.repo + ":" + tag)
	if err != nil {
		return "", fmt.Errorf("image %s tag %q: %w", image, tag, err)
	}
	return named.String(), nil
}

// Options configures Build.
type Options struct {
	OutDir string
	// Tag is the built-in images' tag and their binaries' version, and
	// the tag of a spec whose ref has none.
	Tag string
	// Only restricts the built-in images to these; empty means All, or
	// none when Specs are given.
	Only []string
	// Specs are further images to build (LoadSpec), each into
	// <Name>.tar.
	Specs []*Spec
	// ModuleDir is the repository root the commands are built from;
	// default the current directory.
	ModuleDir string
	// Go is the go command; default "go".
	Go string
	// DebCache keeps downloaded .debs; default DefaultDebCache().
	DebCache string
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
	// Size is the archive's (compressed); RootSize the root
	// filesystem's, uncompressed.
	Size, RootSize int64
	Cached         bool
	Python         string // images with Python
	Packages       []string
}

// stamp is stored next to each archive. Inputs is the hash that decides
// whether to rebuild; the rest is what a cached run reports.
type stamp struct {
	Inputs   string   `json:"inputs"`
	Ref      string   `json:"ref"`
	Digest   string   `json:"digest"`
	Size     int64    `json:"size"`
	RootSize int64    `json:"rootSize,omitempty"`
	Python   string   `json:"python,omitempty"`
	Packages []string `json:"packages,omitempty"`
}

func stampPath(outDir, archive string) string {
	return filepath.Join(outDir, "."+archive+".stamp")
}

// job is one image to build.
type job struct {
	name    string // for logs and errors: the -only name, or the spec's
	archive string // file name in the output folder
	ref     string
	binary  string // a static image's command
	spec    *Spec  // a Debian image's
	labels  map[string]string
}

// jobs lists what o asks for, in build order, with their references, so
// that a bad name or ref fails before anything is built.
func (o *Options) jobs() ([]job, error) {
	only := o.Only
	if len(only) == 0 && len(o.Specs) == 0 {
		only = All
	}
	for _, im := range only {
		if _, ok := builtins[im]; !ok {
			return nil, fmt.Errorf("unknown image %q (known: %s)", im, known())
		}
	}
	if len(only) > 0 && o.Tag == "" {
		return nil, errors.New("a tag is required for the built-in images")
	}
	var jobs []job
	for _, im := range append(slices.Clone(All), OnRequest...) {
		if !slices.Contains(only, im) {
			continue
		}
		ref, err := Ref(im, o.Tag)
		if err != nil {
			return nil, err
		}
		b := builtins[im]
		j := job{name: im, archive: ArchiveName(im), ref: ref, binary: b.binary, labels: map[string]string{
			"org.opencontainers.image.title":   "agentbox-" + im,
			"org.opencontainers.image.version": o.Tag,
		}}
		if b.spec != nil {
			j.spec = b.spec(ref)
		}
		jobs = append(jobs, j)
	}
	for _, s := range o.Specs {
		if err := s.Validate(); err != nil {
			return nil, fmt.Errorf("spec %s: %w", s.Name, err)
		}
		if s.Name == "" {
			return nil, fmt.Errorf("spec %s has no name to call its archive by", s.Ref)
		}
		ref, err := specRef(s.Ref, o.Tag)
		if err != nil {
			return nil, fmt.Errorf("spec %s: ref %w", s.Name, err)
		}
		jobs = append(jobs, job{name: s.Name, archive: s.Name + ".tar", ref: ref, spec: s})
	}
	seen := map[string]bool{}
	for _, j := range jobs {
		if seen[j.archive] {
			return nil, fmt.Errorf("two images would be written to %s", j.archive)
		}
		seen[j.archive] = true
	}
	return jobs, nil
}

// Build builds the images into o.OutDir. Images are independent: a failure
// is reported and the others are still built.
func Build(ctx context.Context, o Options) ([]Result, error) {
	start := time.Now()
	if o.OutDir == "" {
		return nil, errors.New("an output folder is required")
	}
	jobs, err := o.jobs()
	if err != nil {
		return nil, err
	}
	if o.Go == "" {
		o.Go = "go"
	}
	if o.CABundle == "" {
		o.CABundle = HostCABundle
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
	for _, j := range jobs {
		r, err := buildOne(ctx, o, j, builder)
		if err != nil {
			o.logf("%s: FAILED: %v", j.archive, err)
			errs = append(errs, fmt.Errorf("%s: %w", j.name, err))
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
func buildOne(ctx context.Context, o Options, j job, builder string) (Result, error) {
	start := time.Now()
	res := Result{Image: j.name, Ref: j.ref, Archive: filepath.Join(o.OutDir, j.archive)}

	var bin string
	if j.binary != "" {
		t := time.Now()
		bin = filepath.Join(o.OutDir, ".bin", j.binary)
		if err := goBuild(ctx, o, j.binary, bin); err != nil {
			return res, err
		}
		o.logf("%s: go build %s: %s", j.archive, j.binary, since(t))
	}

	in, err := collectInputs(ctx, o, j, builder, bin)
	if err != nil {
		return res, err
	}
	res.Packages = in.packages

	if st, ok := readStamp(o.OutDir, j.archive); ok && st.Inputs == in.hash && archiveMatches(res.Archive, st.Size) {
		res.Cached, res.Digest, res.Size, res.RootSize, res.Python = true, st.Digest, st.Size, st.RootSize, st.Python
		o.logf("%s: up to date: %s %s, root %s (%s)%s", j.archive, j.ref, mb(st.Size), mb(st.RootSize), shortDigest(st.Digest), pythonNote(st.Python))
		return res, nil
	}

	t := time.Now()
	if err := writeImage(ctx, o, j, bin, in, &res); err != nil {
		return res, err
	}
	o.logf("%s: wrote %s %s, root %s (%s)%s: %s (total %s)", j.archive, j.ref, mb(res.Size), mb(res.RootSize), shortDigest(res.Digest), pythonNote(res.Python), since(t), since(start))
	return res, nil
}

// imageInputs is what an image is made of, and the hash of it that
// decides whether the archive must be written again.
type imageInputs struct {
	hash string
	// extra are the files beside the binary (the runsc installer's).
	extra []ExtraFile
	// plan is a Debian image's spec with its base applied; pkgs are its
	// packages, and packages their summary.
	plan     resolved
	pkgs     []Package
	packages []string
	// aptSources is the image's apt sources file, when it holds apt.
	aptSources string
}

// collectInputs gathers the inputs: what the image is made of, and the
// builder itself, whose code decides the layout (hashing it spares a
// version number someone has to remember to bump).
func collectInputs(ctx context.Context, o Options, j job, builder, bin string) (*imageInputs, error) {
	in := &imageInputs{}
	inputs := []string{"builder " + builder, "ref " + j.ref}
	var hashed []string
	if j.spec != nil {
		in.plan = j.spec.resolve()
		if in.plan.sandboxFiles {
			hashed = append(hashed, o.CABundle)
		}
		for _, f := range in.plan.files {
			hashed = append(hashed, f.From)
		}
		// The spec in full: the config, where files go, the links.
		b, err := json.Marshal(j.spec)
		if err != nil {
			return nil, err
		}
		inputs = append(inputs, "spec "+string(b))
	} else {
		hashed = append(hashed, bin, o.CABundle)
	}
	if j.name == RunscInstaller {
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
		inputs = append(inputs, "file "+f+" "+h)
	}
	if j.spec != nil {
		t := time.Now()
		d := o.debian(j, in.plan)
		pkgs, err := d.Resolve(ctx)
		if err != nil {
			return nil, err
		}
		in.pkgs, in.packages = pkgs, PackageSummary(pkgs)
		inputs = append(inputs, "packages "+strings.Join(in.packages, " "))
		o.logf("%s: %d Debian packages resolved with apt-cache: %s", j.archive, len(pkgs), since(t))
		if slices.ContainsFunc(pkgs, func(p Package) bool { return p.Name == "apt" }) {
			if in.aptSources, err = aptSources(ctx); err != nil {
				return nil, err
			}
			inputs = append(inputs, "apt-sources "+in.aptSources)
		}
	}
	sum := sha256.Sum256([]byte(strings.Join(inputs, "\n")))
	in.hash = hex.EncodeToString(sum[:])
	return in, nil
}

func (o *Options) debian(j job, plan resolved) *Debian {
	return &Debian{Packages: plan.packages, Exclude: plan.exclude, CacheDir: o.DebCache,
		Logf: func(f string, a ...any) { o.logf(j.archive+": "+f, a...) }}
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
// filling in res's digest, sizes and Python version.
func writeImage(ctx context.Context, o Options, j job, bin string, in *imageInputs, res *Result) error {
	var digest v1.Hash
	var err error
	if j.spec != nil {
		digest, err = writeDebian(ctx, o, j, in, res)
	} else {
		digest, res.RootSize, err = StaticImage{Ref: j.ref, Name: j.binary, Binary: bin, CABundle: o.CABundle, Labels: j.labels, Extra: in.extra}.write(res.Archive)
	}
	if err != nil {
		return err
	}
	fi, err := os.Stat(res.Archive)
	if err != nil {
		return err
	}
	res.Digest, res.Size = digest.String(), fi.Size()
	return writeStamp(o.OutDir, j.archive, stamp{Inputs: in.hash, Ref: res.Ref, Digest: res.Digest, Size: res.Size,
		RootSize: res.RootSize, Python: res.Python, Packages: res.Packages})
}

// writeDebian builds an image from Debian packages, the one path of the
// sandbox images and of every spec: unpack the packages, add the base's
// files and the spec's, run the checks, write the archive.
func writeDebian(ctx context.Context, o Options, j job, in *imageInputs, res *Result) (v1.Hash, error) {
	logf := func(f string, a ...any) { o.logf(j.archive+": "+f, a...) }
	d := o.debian(j, in.plan)
	t := time.Now()
	debs, err := d.Fetch(ctx, in.pkgs)
	if err != nil {
		return v1.Hash{}, err
	}
	logf("packages in the cache (%s): %s", d.cacheDirOrDefault(), since(t))
	dir, err := os.MkdirTemp(filepath.Dir(res.Archive), ".rootfs-"+j.name+"-")
	if err != nil {
		return v1.Hash{}, err
	}
	defer os.RemoveAll(dir)
	t = time.Now()
	step := progress.Start(logf, "root filesystem", fmt.Sprintf("unpacking %d packages", len(debs)), 0)
	lists, err := unpack(ctx, debs, dir)
	step.Stop()
	if err != nil {
		return v1.Hash{}, err
	}
	names := make([]string, len(in.pkgs))
	for i, p := range in.pkgs {
		names[i] = p.Name
	}
	if slices.Contains(names, "dpkg") {
		if err := writeDpkgDatabase(ctx, dir, debs, lists); err != nil {
			return v1.Hash{}, fmt.Errorf("dpkg's database: %w", err)
		}
	}
	if in.aptSources != "" {
		if _, err := os.Stat(filepath.Join(dir, debianKeyring)); err != nil {
			return v1.Hash{}, fmt.Errorf("apt's sources name %s, which the image lacks: %w", debianKeyring, err)
		}
		if err := writeFile(filepath.Join(dir, aptSourcesFile), in.aptSources, 0o644); err != nil {
			return v1.Hash{}, err
		}
	}
	if in.plan.sandboxFiles {
		err = SandboxFiles(dir, o.CABundle)
	} else {
		// Every image has a /tmp anyone may write to; nothing else is
		// added to an image on base none.
		err = mkdirMode(filepath.Join(dir, "tmp"), 0o777|fs.ModeSticky)
	}
	if err != nil {
		return v1.Hash{}, err
	}
	if err := addFiles(dir, in.plan.files, in.plan.links); err != nil {
		return v1.Hash{}, err
	}
	if res.RootSize, err = dirSize(dir); err != nil {
		return v1.Hash{}, err
	}
	logf("root filesystem unpacked (%s uncompressed): %s", mb(res.RootSize), since(t))
	if os.Geteuid() == 0 {
		t = time.Now()
		if res.Python, err = CheckRootfs(ctx, dir, names, logf); err != nil {
			return v1.Hash{}, err
		}
		logf("checks: %s", since(t))
	} else {
		res.Python = pythonFromPackages(in.pkgs)
		logf("not root: the image's programs not run in a chroot; Python's version from its package")
	}
	// Compressing a few hundred megabytes takes a while on a small machine.
	step = progress.Start(logf, "image archive", "writing and compressing the layer", 0)
	defer step.Stop()
	c := in.plan.config
	return ociimage.WriteArchive(ociimage.Image{
		Ref:        j.ref,
		Rootfs:     dir,
		Entrypoint: c.Entrypoint,
		Cmd:        c.Cmd,
		Env:        c.Env,
		WorkingDir: c.WorkingDir,
		User:       c.User,
		Labels:     j.labels,
	}, res.Archive)
}

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

func readStamp(outDir, archive string) (stamp, bool) {
	var st stamp
	b, err := os.ReadFile(stampPath(outDir, archive))
	if err != nil || json.Unmarshal(b, &st) != nil {
		return stamp{}, false
	}
	return st, true
}

func writeStamp(outDir, archive string, st stamp) error {
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(stampPath(outDir, archive), append(b, '\n'), 0o644)
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
