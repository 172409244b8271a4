// Package failover holds cluster tests that take parts of a running
// platform away under load: the control plane's leader, the kube-apiserver
// and the PostgreSQL store of a highly available release, and the only
// replica of a SQLite one. They check what a user relies on through such a
// loss: a pool lease is never held twice, every call answers within its
// bound with a documented error or succeeds, every succeeded call has its
// audit record and the chain verifies, and every sandbox comes back to the
// state it should be in.
//
// The tests restart the cluster's API server and pause its database, so
// they run on their own: `make test` runs the package after the others.
package failover
