package imagebuild

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// writeDpkgDatabase records the unpacked packages in dpkg's database, for
// an image that holds dpkg: then an image built FROM it (a Dockerfile's
// `RUN apt-get install`) adds packages to these instead of unpacking every
// one again, and apt sees their dependencies met. Each is recorded as
// installed and configured, as it is in a Debian image: its files are in
// place, and what its maintainer scripts would have done that an image
// needs, the build did (the CA bundle, the alternatives' links). Conffiles
// are not recorded; dpkg takes the unpacked ones for the package's own when
// it is upgraded.
//
// lists are the packages' paths as unpack returned them, in debs' order.
func writeDpkgDatabase(ctx context.Context, dir string, debs []string, lists [][]string) error {
	db := filepath.Join(dir, "var/lib/dpkg")
	for _, d := range []string{"info", "updates", "triggers", "alternatives", "parts"} {
		if err := os.MkdirAll(filepath.Join(db, d), 0o755); err != nil {
			return err
		}
	}
	var status bytes.Buffer
	for i, deb := range debs {
		control, members, err := controlMembers(ctx, deb)
		if err != nil {
			return fmt.Errorf("%s: %w", filepath.Base(deb), err)
		}
		fields := controlFields(control)
		name := fields["Package"]
		if name == "" {
			return fmt.Errorf("%s: control file names no package", filepath.Base(deb))
		}
		// Multi-Arch: same packages can be installed for several
		// architectures at once, so dpkg names their files by both.
		info := name
		if fields["Multi-Arch"] == "same" {
			info += ":" + fields["Architecture"]
		}
		status.WriteString(withStatus(control))
		status.WriteString("\n")
		if err := writeFile(filepath.Join(db, "info", info+".list"), strings.Join(lists[i], "\n")+"\n", 0o644); err != nil {
			return err
		}
		for _, m := range members {
			if err := os.WriteFile(filepath.Join(db, "info", info+"."+m.name), m.data, m.mode); err != nil {
				return err
			}
			if err := os.Chmod(filepath.Join(db, "info", info+"."+m.name), m.mode); err != nil {
				return err
			}
		}
	}
	if err := writeFile(filepath.Join(db, "status"), status.String(), 0o644); err != nil {
		return err
	}
	if err := writeFile(filepath.Join(db, "available"), "", 0o644); err != nil {
		return err
	}
	// The info folder's layout: 1 names a Multi-Arch: same package's
	// files pkg:arch.*, as above; without it dpkg looks for pkg.*.
	if err := writeFile(filepath.Join(db, "info", "format"), "1\n", 0o644); err != nil {
		return err
	}
	if err := caCertificatesConf(dir); err != nil {
		return err
	}
	return writeFile(filepath.Join(dir, "etc/dpkg/dpkg.cfg.d/excludes"), dpkgExcludes, 0o644)
}

// caCertificatesConf writes the list of enabled certificates that
// ca-certificates' maintainer script would have: every one the package
// ships. update-ca-certificates reads it whenever the package's trigger
// runs (a later package installs a certificate) or a Dockerfile adds its
// own CA, and without it would not know the bundle's certificates.
func caCertificatesConf(dir string) error {
	certs := filepath.Join(dir, "usr/share/ca-certificates")
	if _, err := os.Stat(certs); err != nil {
		return nil
	}
	var b strings.Builder
	b.WriteString("# The certificates of /usr/share/ca-certificates that update-ca-certificates(8)\n" +
		"# puts in /etc/ssl/certs; a line beginning with ! deselects one.\n")
	err := filepath.WalkDir(certs, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".crt") {
			return err
		}
		rel, err := filepath.Rel(certs, p)
		b.WriteString(filepath.ToSlash(rel) + "\n")
		return err
	})
	if err != nil {
		return err
	}
	return writeFile(filepath.Join(dir, "etc/ca-certificates.conf"), b.String(), 0o644)
}

// dpkgExcludes make dpkg leave out of the packages installed later what
// the build left out of these (skipPath).
const dpkgExcludes = `# What the image's build left out of its packages (documentation, manuals,
# translations), left out of the packages installed later too.
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-exclude=/usr/share/lintian/*
path-exclude=/usr/share/bug/*
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
`

type controlMember struct {
	name string
	data []byte
	mode fs.FileMode
}

// controlMembers reads a package's control archive: the control file, and
// the others (md5sums, maintainer scripts, triggers, ...) dpkg keeps in its
// info folder.
func controlMembers(ctx context.Context, deb string) (string, []controlMember, error) {
	out, err := runOut(ctx, "dpkg-deb", "--ctrl-tarfile", deb)
	if err != nil {
		return "", nil, err
	}
	tr := tar.NewReader(bytes.NewReader(out))
	var control string
	var members []controlMember
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return "", nil, err
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			return "", nil, err
		}
		switch name := strings.TrimPrefix(h.Name, "./"); name {
		case "control":
			control = string(b)
		default:
			members = append(members, controlMember{name: name, data: b, mode: fs.FileMode(h.Mode).Perm()})
		}
	}
	if control == "" {
		return "", nil, fmt.Errorf("no control file in %s", filepath.Base(deb))
	}
	return control, members, nil
}

// controlFields reads a control file's single-line fields.
func controlFields(control string) map[string]string {
	f := map[string]string{}
	for _, line := range strings.Split(control, "\n") {
		if k, v, ok := strings.Cut(line, ": "); ok && !strings.HasPrefix(line, " ") {
			f[k] = strings.TrimSpace(v)
		}
	}
	return f
}

// withStatus is a control file as a stanza of dpkg's status file: its
// Status after the Package field, as dpkg writes it.
func withStatus(control string) string {
	control = strings.TrimRight(control, "\n") + "\n"
	pkgLine, rest, _ := strings.Cut(control, "\n")
	return pkgLine + "\nStatus: install ok installed\n" + rest
}

// aptSource is one Debian archive the host's apt takes packages from.
type aptSource struct {
	uri, suite string
	components []string
}

// policySource matches a package file line of `apt-cache policy`:
// " 500 URI SUITE/COMPONENT ARCH Packages".
var policySource = regexp.MustCompile(`^\s*-?\d+\s+(\S+)\s+(\S+)/(\S+)\s+\S+\s+Packages$`)

// debianSources reads, from `apt-cache policy` output, the archives whose
// release file names Debian as their origin: the image gets those and no
// other of the host's sources (a vendor's repository needs a key the
// image lacks).
func debianSources(policy []byte) []aptSource {
	var out []aptSource
	var cur *aptSource
	sc := bufio.NewScanner(bytes.NewReader(policy))
	for sc.Scan() {
		line := sc.Text()
		if m := policySource.FindStringSubmatch(line); m != nil {
			cur = &aptSource{uri: m[1], suite: m[2], components: []string{m[3]}}
			continue
		}
		release, ok := strings.CutPrefix(strings.TrimSpace(line), "release ")
		if !ok || cur == nil {
			continue
		}
		if slices.Contains(strings.Split(release, ","), "o=Debian") {
			i := slices.IndexFunc(out, func(s aptSource) bool { return s.uri == cur.uri && s.suite == cur.suite })
			if i < 0 {
				out = append(out, *cur)
			} else if !slices.Contains(out[i].components, cur.components[0]) {
				out[i].components = append(out[i].components, cur.components[0])
			}
		}
		cur = nil
	}
	for i := range out {
		slices.Sort(out[i].components)
	}
	return out
}

// aptSources is the sources file an image that holds apt gets: the
// Debian archives the host's apt uses (so no mirror is named in the
// repository), signed by the keyring of debian-archive-keyring, which apt
// depends on.
func aptSources(ctx context.Context) (string, error) {
	policy, err := runOut(ctx, "apt-cache", append(slices.Clone(aptCacheArgs), "policy")...)
	if err != nil {
		return "", err
	}
	sources := debianSources(policy)
	if len(sources) == 0 {
		return "", fmt.Errorf("apt-cache policy names no archive whose origin is Debian, for the image's apt sources")
	}
	var b strings.Builder
	b.WriteString("# The Debian archives the image was built from.\n")
	for _, s := range sources {
		fmt.Fprintf(&b, "\nTypes: deb\nURIs: %s\nSuites: %s\nComponents: %s\nSigned-By: %s\n",
			s.uri, s.suite, strings.Join(s.components, " "), debianKeyring)
	}
	return b.String(), nil
}

const debianKeyring = "/usr/share/keyrings/debian-archive-keyring.gpg"

// aptSourcesFile is where the image's apt reads aptSources.
const aptSourcesFile = "etc/apt/sources.list.d/debian.sources"
