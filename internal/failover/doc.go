// Package failover holds cluster tests that take parts of a running
// platform away under load: the control plane's leader, the kube-apiserver
// and the PostgreSQL store of a highly available release, and the only
// replica of a SQLite one. They check what a user relies on through such a
// loss: a pool lease is never held twice, every call answers within its
// bound with a documented error or succeeds, every succeeded call has its
// audit record and the chain verifies, and every sandbox comes back to the
// state it should be in.
//
// The tests take several minutes each and restart the cluster's API server
// under everything else, so they run in `make bench`, which runs one
// package at a time, and print their figures (how long the API was away
// after each fault, how long a new leader took) into its table. The
// invariants are asserted.
package failover
