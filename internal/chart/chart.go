// Package chart loads the agentbox Helm chart embedded in the provider and
// installs, upgrades, inspects and uninstalls it with the Helm SDK.
//
// It knows nothing about Terraform, so that the same code serves the
// provider, tests and any tool that wants to install the platform from Go.
package chart

import (
	"bytes"
	"fmt"
	"io/fs"
	"path"
	"sync"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/ignore"

	"github.com/agentbox/terraform-provider-agentbox/charts"
)

// Names the chart gives its objects. They are fixed rather than derived from
// the release name (see templates/_helpers.tpl), so callers may rely on them.
const (
	ChartName                = "agentbox"
	ControlPlaneDeployment   = "agentbox-controlplane"
	APIService               = "agentbox-api"
	DefaultCASecret          = "agentbox-ca"
	DefaultAdminTokenSecret  = "agentbox-admin-token"
	AdminTokenKey            = "token"
	CACertificateKey         = "tls.crt"
	DefaultReleaseName       = "agentbox"
	DefaultPlatformNamespace = "agentbox-system"
)

// Load parses the embedded chart. Every call returns a new copy, because
// Helm's actions may modify the chart they are given (values of
// dependencies, for one).
func Load() (*chart.Chart, error) { return loadFS(charts.FS, ChartName) }

// metadata is parsed once for Version and AppVersion, which callers such as
// a Terraform schema need without handling an error: the embedded chart is
// part of the binary and covered by tests, so it always loads.
var metadata = sync.OnceValue(func() *chart.Metadata {
	c, err := Load()
	if err != nil {
		panic(fmt.Sprintf("the embedded chart does not load: %v", err))
	}
	return c.Metadata
})

// Version is the embedded chart's version.
func Version() string { return metadata().Version }

// AppVersion is the embedded chart's appVersion: the default tag of the
// platform's images.
func AppVersion() string { return metadata().AppVersion }

// loadFS reads the chart in dir of fsys the way `helm package` would,
// honouring its .helmignore, because loader.LoadFiles itself applies no
// ignore rules.
func loadFS(fsys fs.FS, dir string) (*chart.Chart, error) {
	rules := ignore.Empty()
	if data, err := fs.ReadFile(fsys, path.Join(dir, ignore.HelmIgnore)); err == nil {
		if rules, err = ignore.Parse(bytes.NewReader(data)); err != nil {
			return nil, fmt.Errorf("parsing %s: %w", ignore.HelmIgnore, err)
		}
	}
	rules.AddDefaults()

	var files []*loader.BufferedFile
	err := fs.WalkDir(fsys, dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel := p[len(dir):]
		if rel == "" {
			return nil
		}
		rel = rel[1:]
		info, err := d.Info()
		if err != nil {
			return err
		}
		if rules.Ignore(rel, info) {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		if d.IsDir() {
			return nil
		}
		data, err := fs.ReadFile(fsys, p)
		if err != nil {
			return err
		}
		files = append(files, &loader.BufferedFile{Name: rel, Data: data})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("reading the embedded chart: %w", err)
	}
	c, err := loader.LoadFiles(files)
	if err != nil {
		return nil, fmt.Errorf("loading the embedded chart: %w", err)
	}
	return c, nil
}
