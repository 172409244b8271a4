// Package bench holds the end-to-end benchmarks of `make bench`: figures
// measured on the real local cluster with the platform installed through
// Terraform, as users install it. Its tests run only when AGENTBOX_BENCH is
// set and print figures (see internal/benchreport); they assert behaviour,
// never a time.
package bench
