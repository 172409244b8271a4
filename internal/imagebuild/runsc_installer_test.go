package imagebuild

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
)

// TestRunscInstallerImage builds the runsc installer image from stand-in
// gVisor binaries: they must land in RunscImageDir, executable, and a
// changed binary must rebuild the image.
func TestRunscInstallerImage(t *testing.T) {
	if _, err := os.Stat(HostCABundle); err != nil {
		t.Skipf("skipping: %s missing (apt-get install ca-certificates)", HostCABundle)
	}
	if slices.Contains(All, RunscInstaller) {
		t.Error("the runsc installer is built by default, so `make images` would need `make testenv` first")
	}
	moduleDir, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	runscDir := t.TempDir()
	for _, b := range RunscBinaries {
		if err := os.WriteFile(filepath.Join(runscDir, b), []byte("#!/bin/sh\necho "+b+" 1\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var log strings.Builder
	o := Options{OutDir: t.TempDir(), Tag: "test", Only: []string{RunscInstaller}, ModuleDir: moduleDir, RunscDir: runscDir, Out: &log}
	first, err := Build(context.Background(), o)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	if len(first) != 1 || first[0].Ref != "docker.io/agentbox/agentbox-runsc-installer:test" {
		t.Fatalf("results %+v", first)
	}
	files := imageFiles(t, first[0].Archive, first[0].Digest)
	for _, b := range append([]string{"usr/local/bin/agentbox-runsc-installer"}, RunscBinaries...) {
		p := b
		if !strings.Contains(b, "/") {
			p = strings.TrimPrefix(RunscImageDir, "/") + "/" + b
		}
		f, ok := files[p]
		if !ok {
			t.Errorf("image lacks %s", p)
			continue
		}
		if f.mode&0o777 != 0o755 {
			t.Errorf("%s mode %o, want 755", p, f.mode)
		}
		if p != "usr/local/bin/agentbox-runsc-installer" {
			want, _ := os.ReadFile(filepath.Join(runscDir, b))
			if !bytes.Equal(f.content, want) {
				t.Errorf("%s is %q, want %q", p, f.content, want)
			}
		}
	}

	second, err := Build(context.Background(), o)
	if err != nil || !second[0].Cached {
		t.Fatalf("unchanged inputs: %+v %v", second, err)
	}
	// A new gVisor is a new image.
	if err := os.WriteFile(filepath.Join(runscDir, "runsc"), []byte("#!/bin/sh\necho runsc 2\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	third, err := Build(context.Background(), o)
	if err != nil || third[0].Cached || third[0].Digest == first[0].Digest {
		t.Fatalf("after runsc changed: %+v %v", third, err)
	}
	t.Log(log.String())

	o.RunscDir = ""
	if _, err := Build(context.Background(), o); err == nil || !strings.Contains(err.Error(), "-runsc-dir") {
		t.Errorf("no runsc folder: %v", err)
	}
	o.RunscDir = t.TempDir()
	if _, err := Build(context.Background(), o); err == nil || !strings.Contains(err.Error(), "make testenv") {
		t.Errorf("runsc folder without runsc: %v", err)
	}
}

type imageFile struct {
	mode    int64
	content []byte
}

func imageFiles(t *testing.T, archive, digest string) map[string]imageFile {
	t.Helper()
	dir := t.TempDir()
	untar(t, archive, dir)
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil || len(im.Manifests) != 1 || im.Manifests[0].Digest.String() != digest {
		t.Fatalf("index %+v %v, want one image %s", im, err, digest)
	}
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]imageFile{}
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			files[h.Name] = imageFile{mode: h.Mode, content: b}
		}
	}
}
