package v1alpha1

// LocalObjectReference names an object of a known kind in the referrer's
// namespace. Unlike corev1.LocalObjectReference its name is required, so an
// empty reference is rejected instead of silently pointing at nothing.
// +structType=atomic
type LocalObjectReference struct {
	// name of the referenced object, in the same namespace.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`
}

// SecretKeySelector selects one key of a Secret in the referrer's namespace.
// +structType=atomic
type SecretKeySelector struct {
	// name of the Secret, in the same namespace as the referring object.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`

	// key within the Secret's data.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[-._a-zA-Z0-9]+$`
	Key string `json:"key"`
}
