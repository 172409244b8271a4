// Package v1alpha1 holds the agentbox.dev/v1alpha1 API: the custom resources
// through which the Terraform provider declares the platform and the control
// plane reconciles it. It depends only on k8s.io/api and k8s.io/apimachinery,
// so every other package can import it.
//
// The deep-copy functions and the CRDs in charts/agentbox/crds are generated
// from these types; run `make generate` after changing them.
//
// +kubebuilder:object:generate=true
// +groupName=agentbox.dev
package v1alpha1

//go:generate go run sigs.k8s.io/controller-tools/cmd/controller-gen@v0.23.0 object crd:crdVersions=v1 paths=. output:crd:artifacts:config=../../../charts/agentbox/crds
