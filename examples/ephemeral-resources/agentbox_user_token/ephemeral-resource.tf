resource "agentbox_platform" "this" {}

# A short-lived token saying agent "support-bot" acts for user "u-1234",
# for the GitHub MCP server; never written to the plan or the state. Pass
# it where Terraform takes ephemeral values: a write-only argument, a
# provider block, another ephemeral resource.
ephemeral "agentbox_user_token" "github" {
  api_endpoint   = agentbox_platform.this.api_endpoint
  ca_certificate = agentbox_platform.this.ca_certificate
  token          = agentbox_platform.this.admin_token
  user           = "u-1234"
  agent_id       = "support-bot"
  audience       = "https://mcp.github.example"
  scope          = "repo:read"
  ttl_seconds    = 900
}
