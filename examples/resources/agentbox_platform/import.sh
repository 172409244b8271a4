# A platform is imported by "<namespace>/<release_name>" of its Helm release,
# also one installed with plain `helm install`.
terraform import agentbox_platform.this agentbox-system/agentbox
