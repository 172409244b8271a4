// Command terraform-provider-agentbox serves the agentbox Terraform provider.
package main

import (
	"context"
	"flag"
	"log"

	"github.com/hashicorp/terraform-plugin-framework/providerserver"

	"github.com/agentbox/terraform-provider-agentbox/provider"
)

// version is stamped by the release build with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	var debug bool
	flag.BoolVar(&debug, "debug", false, "run the provider in debug mode, for attaching a debugger such as delve; "+
		"it prints the TF_REATTACH_PROVIDERS value to give Terraform")
	flag.Parse()

	err := providerserver.Serve(context.Background(), provider.New(version), providerserver.ServeOpts{
		Address:         "registry.terraform.io/agentbox/agentbox",
		Debug:           debug,
		ProtocolVersion: 6,
	})
	if err != nil {
		log.Fatal(err.Error())
	}
}
