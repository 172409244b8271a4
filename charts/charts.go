// Package charts embeds the agentbox Helm chart, so that the provider
// installs exactly the chart it was built with and needs no chart repository.
//
// This is the only Go file under charts/: it sits beside the chart folder, so
// the chart itself (what `helm package` ships) holds no Go code.
package charts

import "embed"

// FS holds the chart folder "agentbox". The all: prefix keeps files that
// start with a dot or an underscore, such as .helmignore and
// templates/_helpers.tpl.
//
//go:embed all:agentbox
var FS embed.FS
