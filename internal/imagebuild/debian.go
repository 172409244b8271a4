package imagebuild

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/agentbox/terraform-provider-agentbox/internal/progress"
)

// Debian builds a root filesystem from Debian packages fetched by apt as the
// host configures it (its sources, mirror, proxy and keys), so no mirror is
// named anywhere in the repository. Nothing is installed on the host and no
// maintainer script runs: the packages are unpacked, which is all a
// read-only, single-purpose image needs.
type Debian struct {
	// Packages are the roots; their Depends and PreDepends are added.
	Packages []string
	// Exclude names packages left out, together with whatever only they
	// pulled in.
	Exclude []string
	// CacheDir keeps downloaded .debs by name, version and architecture;
	// default DefaultDebCache().
	CacheDir string
	// Logf reports progress; nil is quiet.
	Logf func(format string, args ...any)
}

// Package is one resolved Debian package.
type Package struct {
	Name, Version, Architecture string
	SHA256                      string
	Size                        int64
}

func (p Package) String() string { return p.Name + "=" + p.Version }

// debFile is the cache file name, apt's own naming (an epoch's colon
// written %3a).
func (p Package) debFile() string {
	return p.Name + "_" + strings.ReplaceAll(p.Version, ":", "%3a") + "_" + p.Architecture + ".deb"
}

// DefaultDebCache is where downloaded packages are kept between builds.
func DefaultDebCache() (string, error) {
	c, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("no user cache directory for downloaded packages: %w", err)
	}
	return filepath.Join(c, "agentbox", "debs"), nil
}

func (d *Debian) logf(format string, args ...any) {
	if d.Logf != nil {
		d.Logf(format, args...)
	}
}

// aptCacheArgs make apt-cache choose versions as for an empty system:
// what the host has installed says nothing about an image, and a package
// installed from elsewhere (a newer nodejs from a vendor's repository, since
// removed) would otherwise be the candidate though no source offers it.
var aptCacheArgs = []string{"-o", "Dir::State::status=/dev/null"}

// aptDependsArgs ask apt-cache for hard dependencies only: recommends and
// suggests are what make Debian installs large, and conflicts and the like
// say nothing about what to unpack.
var aptDependsArgs = append(slices.Clone(aptCacheArgs), "depends", "--recurse", "--no-recommends", "--no-suggests",
	"--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances")

// Resolve returns the dependency closure of d.Packages at the versions apt
// would install now.
func (d *Debian) Resolve(ctx context.Context) ([]Package, error) {
	if len(d.Packages) == 0 {
		return nil, errors.New("no Debian packages named")
	}
	out, err := runOut(ctx, "apt-cache", append(append([]string{}, aptDependsArgs...), d.Packages...)...)
	if err != nil {
		return nil, fmt.Errorf("%w (is apt usable here, and has `apt-get update` run?)", err)
	}
	g, err := ParseDepends(bytes.NewReader(out))
	if err != nil {
		return nil, err
	}
	names, err := g.Closure(d.Packages, d.Exclude)
	if err != nil {
		return nil, err
	}
	out, err = runOut(ctx, "apt-cache", append(append(slices.Clone(aptCacheArgs), "show", "--no-all-versions"), names...)...)
	if err != nil {
		return nil, err
	}
	pkgs, err := parseShow(out)
	if err != nil {
		return nil, err
	}
	byName := map[string]Package{}
	for _, p := range pkgs {
		byName[p.Name] = p
	}
	res := make([]Package, 0, len(names))
	for _, n := range names {
		p, ok := byName[n]
		if !ok {
			return nil, fmt.Errorf("apt-cache show printed no record for %s", n)
		}
		res = append(res, p)
	}
	return res, nil
}

// parseShow reads the deb822 stanzas of apt-cache show.
func parseShow(b []byte) ([]Package, error) {
	var pkgs []Package
	for _, stanza := range strings.Split(strings.TrimSpace(string(b)), "\n\n") {
		var p Package
		var filename string
		for _, line := range strings.Split(stanza, "\n") {
			k, v, ok := strings.Cut(line, ": ")
			if !ok || strings.HasPrefix(line, " ") {
				continue
			}
			switch k {
			case "Package":
				p.Name = v
			case "Version":
				p.Version = v
			case "Architecture":
				p.Architecture = v
			case "SHA256":
				p.SHA256 = v
			case "Filename":
				filename = v
			case "Size":
				p.Size, _ = strconv.ParseInt(v, 10, 64)
			}
		}
		if p.Name == "" {
			continue
		}
		if filename == "" || p.SHA256 == "" {
			return nil, fmt.Errorf("%s %s is known to apt but not downloadable (run `apt-get update`?)", p.Name, p.Version)
		}
		pkgs = append(pkgs, p)
	}
	return pkgs, nil
}

// Fetch makes sure every package is in the cache and returns the .deb
// paths, in the order given. Cached files are checked against apt's hash,
// so a truncated download is fetched again rather than unpacked.
func (d *Debian) Fetch(ctx context.Context, pkgs []Package) ([]string, error) {
	dir := d.CacheDir
	if dir == "" {
		var err error
		if dir, err = DefaultDebCache(); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	paths := make([]string, len(pkgs))
	var missing []Package
	for i, p := range pkgs {
		paths[i] = filepath.Join(dir, p.debFile())
		if ok, err := hasHash(paths[i], p.SHA256); err != nil {
			return nil, err
		} else if !ok {
			missing = append(missing, p)
		}
	}
	if len(missing) == 0 {
		return paths, nil
	}
	tmp, err := os.MkdirTemp(dir, ".download-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	args := []string{"download", "-q"}
	if os.Geteuid() == 0 {
		// apt drops to its _apt user for downloads, which cannot write
		// into root's private cache directory; it would fall back to root
		// anyway, after a warning on every run.
		args = append(args, "-o", "APT::Sandbox::User=root")
	}
	for _, p := range missing {
		args = append(args, p.Name+"="+p.Version)
	}
	d.logf("downloading %d packages with apt-get", len(missing))
	got := 0
	dl := progress.Cmd{Dir: tmp, Logf: d.logf, Label: "apt-get download"}
	if err := dl.Run(ctx, fmt.Sprintf("0/%d packages", len(missing)), func(s *progress.Step, text string) {
		if strings.HasPrefix(text, "Get:") {
			got++
			s.Set("%d/%d packages (last %s)", got, len(missing), text)
		}
	}, "apt-get", args...); err != nil {
		return nil, fmt.Errorf("apt-get download: %w", err)
	}
	for _, p := range missing {
		got := filepath.Join(tmp, p.debFile())
		if ok, err := hasHash(got, p.SHA256); err != nil || !ok {
			return nil, fmt.Errorf("apt-get download %s: %s missing or not matching apt's SHA256 (%v)", p, p.debFile(), err)
		}
		if err := os.Rename(got, filepath.Join(dir, p.debFile())); err != nil {
			return nil, err
		}
	}
	return paths, nil
}

func hasHash(p, want string) (bool, error) {
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return false, err
	}
	return hex.EncodeToString(h.Sum(nil)) == want, nil
}

// mergedUsr are the top-level folders that Debian (since bookworm) keeps
// under /usr with a symlink in their place. Packages still ship some files
// under the old paths; they are moved to /usr while unpacking, as dpkg does
// on a merged system, and the symlinks keep the old paths working.
var mergedUsr = []string{"bin", "sbin", "lib", "lib64"}

// Unpack extracts debs, in order, into dir, which must be empty or missing.
//
// It reads each package's data with `dpkg-deb --fsys-tarfile` and writes
// the files itself rather than through `dpkg -x`: tar, which dpkg -x runs,
// replaces a symlinked /lib with a real folder, breaking the merged-/usr
// layout. Writes go through an os.Root, so no entry can land outside dir.
func Unpack(ctx context.Context, debs []string, dir string) error {
	_, err := unpack(ctx, debs, dir)
	return err
}

// unpack is Unpack, also returning each package's paths as it ships
// them (./bin/tar as /bin/tar, skipped ones too), what dpkg's file lists
// record.
func unpack(ctx context.Context, debs []string, dir string) ([][]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	for _, d := range mergedUsr {
		if err := root.MkdirAll("usr/"+d, 0o755); err != nil {
			return nil, err
		}
		if err := root.Symlink("usr/"+d, d); err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, err
		}
	}
	lists := make([][]string, len(debs))
	for i, deb := range debs {
		if lists[i], err = unpackDeb(ctx, root, deb); err != nil {
			return nil, fmt.Errorf("unpacking %s: %w", filepath.Base(deb), err)
		}
	}
	return lists, nil
}

func unpackDeb(ctx context.Context, root *os.Root, deb string) (list []string, err error) {
	cmd := exec.CommandContext(ctx, "dpkg-deb", "--fsys-tarfile", deb)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("dpkg-deb: %w", err)
	}
	defer func() {
		// Drain so dpkg-deb never blocks writing after an early error.
		io.Copy(io.Discard, out)
		if werr := cmd.Wait(); werr != nil && err == nil {
			err = fmt.Errorf("dpkg-deb --fsys-tarfile: %w: %s", werr, strings.TrimSpace(stderr.String()))
		}
	}()
	return extractTar(root, tar.NewReader(bufio.NewReaderSize(out, 1<<20)))
}

// listPath is how dpkg's file lists name an archive entry: ./bin/ as
// /bin, ./ as /.
func listPath(hdrName string) string {
	p := path.Clean("/" + strings.TrimPrefix(hdrName, "./"))
	if p == "/" {
		return "/."
	}
	return p
}

// usrPath maps a package path to where it lives on a merged-/usr system.
func usrPath(name string) string {
	first, _, _ := strings.Cut(name, "/")
	for _, d := range mergedUsr {
		if first == d {
			return "usr/" + name
		}
	}
	return name
}

// skipPath leaves out what a non-interactive, read-only image never reads:
// documentation, manuals and translations. Copyright files stay, as the
// licences of the packages ask.
//
// glibc's gconv modules go too, a sixth of the sandbox: they only serve
// iconv() for legacy character sets (UTF-8, UTF-16/32 and Latin-1 are built
// into glibc), and Python has codecs of its own.
func skipPath(name string) bool {
	for _, p := range []string{"usr/share/man/", "usr/share/info/", "usr/share/locale/", "usr/share/lintian/", "usr/share/bug/"} {
		if strings.HasPrefix(name+"/", p) {
			return true
		}
	}
	if parts := strings.SplitN(name, "/", 5); len(parts) >= 4 && parts[0] == "usr" && parts[1] == "lib" && parts[3] == "gconv" {
		return true
	}
	if rest, ok := strings.CutPrefix(name, "usr/share/doc/"); ok {
		// Keep usr/share/doc/PKG (a folder, or a symlink to the folder of
		// the package it comes from) and PKG/copyright.
		parts := strings.Split(rest, "/")
		return !(len(parts) == 1 || (len(parts) == 2 && parts[1] == "copyright"))
	}
	return false
}

// extractTar unpacks a package's data archive into root, with /bin, /lib
// and the like merged into /usr, and skips what the sandbox never reads.
func extractTar(root *os.Root, tr *tar.Reader) ([]string, error) {
	asRoot := os.Geteuid() == 0
	buf := make([]byte, 256<<10)
	var list []string
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return list, nil
		}
		if err != nil {
			return nil, err
		}
		list = append(list, listPath(hdr.Name))
		name, ok := entryPath(hdr.Name)
		if !ok {
			continue
		}
		if parent := path.Dir(name); parent != "." {
			if err := root.MkdirAll(parent, 0o755); err != nil {
				return nil, err
			}
		}
		if err := extractEntry(root, tr, hdr, name, buf); err != nil {
			return nil, err
		}
		// Only root can give files away; a build by another user leaves
		// them its own, which ociimage then records as root's.
		if asRoot && (hdr.Uid != 0 || hdr.Gid != 0) {
			if err := root.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
				return nil, err
			}
		}
	}
}

// entryPath is where an archive entry goes in the root filesystem; !ok
// for the root itself and for what skipPath leaves out.
func entryPath(hdrName string) (string, bool) {
	name := path.Clean(strings.TrimPrefix(hdrName, "./"))
	if name == "." || name == "/" {
		return "", false
	}
	name = usrPath(strings.TrimPrefix(name, "/"))
	if skipPath(name) {
		return "", false
	}
	return name, true
}

// entryMode converts tar's Unix mode bits to Go's, which keep setuid,
// setgid and sticky in different places.
func entryMode(hdrMode int64) fs.FileMode {
	mode := fs.FileMode(hdrMode).Perm()
	if hdrMode&0o4000 != 0 {
		mode |= fs.ModeSetuid
	}
	if hdrMode&0o2000 != 0 {
		mode |= fs.ModeSetgid
	}
	if hdrMode&0o1000 != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}

// extractEntry creates one entry at name, replacing any file an earlier
// package left there.
func extractEntry(root *os.Root, tr *tar.Reader, hdr *tar.Header, name string, buf []byte) error {
	mode := entryMode(hdr.Mode)
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := root.MkdirAll(name, 0o755); err != nil {
			return err
		}
		return root.Chmod(name, mode)
	case tar.TypeReg:
		if err := removeNonDir(root, name); err != nil {
			return err
		}
		return extractFile(root, tr, name, mode, buf)
	case tar.TypeSymlink:
		if err := removeNonDir(root, name); err != nil {
			return err
		}
		return root.Symlink(hdr.Linkname, name)
	case tar.TypeLink:
		if err := removeNonDir(root, name); err != nil {
			return err
		}
		target := usrPath(path.Clean(strings.TrimPrefix(strings.TrimPrefix(hdr.Linkname, "./"), "/")))
		return root.Link(target, name)
	default:
		return fmt.Errorf("%s: unsupported entry type %q in a package", name, hdr.Typeflag)
	}
}

func extractFile(root *os.Root, tr *tar.Reader, name string, mode fs.FileMode, buf []byte) error {
	f, err := root.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = io.CopyBuffer(f, tr, buf)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	// After writing, and not through OpenFile, so that neither the umask
	// nor the write clears setuid and setgid bits.
	return root.Chmod(name, mode)
}

// removeNonDir clears the way for a file where an earlier package put one:
// later packages win, as with dpkg (which would ask for a Replaces).
func removeNonDir(root *os.Root, name string) error {
	fi, err := root.Lstat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return fmt.Errorf("%s: a package ships a file where another has a folder", name)
	}
	return root.Remove(name)
}

// PackageSummary lists packages as "name=version", sorted, for stamps and
// logs.
func PackageSummary(pkgs []Package) []string {
	s := make([]string, len(pkgs))
	for i, p := range pkgs {
		s[i] = p.String()
	}
	sort.Strings(s)
	return s
}

func runOut(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		// Named by its subcommand, past the options.
		shown := args
		for len(shown) > 1 && shown[0] == "-o" {
			shown = shown[2:]
		}
		return nil, fmt.Errorf("%s %s: %w: %s", name, strings.Join(shown[:min(len(shown), 2)], " "), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}
