#!/bin/sh
# What public Node.js images run first: a first argument that is an option,
# or not a command, is given to node.
set -e
if [ "${1#-}" != "${1}" ] || [ -z "$(command -v "${1}")" ]; then
  set -- node "$@"
fi
exec "$@"
