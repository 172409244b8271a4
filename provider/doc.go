// Package provider is the agentbox Terraform provider: it turns Terraform
// configuration into the agentbox platform's Helm release and custom
// resources, and reads them back into state.
//
// Each resource and data source has a file of its own, named for it. What
// they share lives in files named for the job:
//
//   - provider.go: the provider's settings and the clients they configure;
//   - objects.go: the client for the cluster's objects and what its errors mean;
//   - ids.go: IDs, import IDs and namespaces of namespaced objects;
//   - custom_resource.go: create, read, update, delete and the wait for
//     readiness, as every resource that wraps one custom resource does them;
//   - wait.go: polling an object until it is ready or gone;
//   - attributes.go, tolerations.go: schema attributes several resources declare;
//   - data_source.go: data source schemas derived from the resources' own;
//   - validators.go: validation rules, each with the description docs quote;
//   - values.go: conversions between Terraform values and Kubernetes ones;
//   - markdown.go: lists of names written into descriptions.
package provider
