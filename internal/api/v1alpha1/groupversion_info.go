package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupName is the API group of every agentbox resource.
const GroupName = "agentbox.dev"

var (
	// GroupVersion is the group and version of the types in this package.
	GroupVersion = schema.GroupVersion{Group: GroupName, Version: "v1alpha1"}

	// SchemeBuilder registers the types in this package with a scheme. It is
	// the apimachinery builder rather than controller-runtime's, so the package
	// stays free of controller-runtime.
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)

	// AddToScheme adds the types in this package to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

// Resource returns the group-qualified resource for an unqualified one, as
// apierrors and listers expect.
func Resource(resource string) schema.GroupResource {
	return GroupVersion.WithResource(resource).GroupResource()
}

func addKnownTypes(scheme *runtime.Scheme) error {
	scheme.AddKnownTypes(GroupVersion,
		&Sandbox{}, &SandboxList{},
		&SandboxTemplate{}, &SandboxTemplateList{},
		&SandboxWarmPool{}, &SandboxWarmPoolList{},
		&EgressProxy{}, &EgressProxyList{},
		&GVisorNodePool{}, &GVisorNodePoolList{},
		&RunSchedule{}, &RunScheduleList{},
	)
	metav1.AddToGroupVersion(scheme, GroupVersion)
	return nil
}
