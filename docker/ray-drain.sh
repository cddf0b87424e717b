#!/usr/bin/env bash
# A Ray pod's preStop (deploy/kuberay/rayservice.yaml): drain this Ray node so that its open streams finish before
# Kubernetes stops the pod.
#
#   orpheus-ray-drain SECONDS            (SECONDS: the app's drain_timeout; the pod's grace period is longer)
#
# It marks the node draining in Ray's GCS with a deadline SECONDS away (`ray drain-node`, reason PREEMPTION: the
# same request Ray's autoscaler makes before it removes a node). Ray Serve (2.60 and later: older releases ignore a
# draining node) then routes no new request to the node's replicas, starts their replacements elsewhere and stops
# them gracefully: each has its graceful_shutdown_timeout_s (the app's drain_timeout) to finish its open streams.
# Once the node is idle its raylet exits, and then this script; after SECONDS at the latest. A refused drain (the
# head node, whose loss ends the cluster anyway) or an unreachable GCS returns at once: the pod stops as before.
# The node is the one a driver started here joins (the pod's only one; RAY_ADDRESS, which KubeRay sets, names the
# cluster); ORPHEUS_DRAIN_NODE_ID names another (tests run several nodes on one host).
set -u
seconds=${1:?usage: orpheus-ray-drain SECONDS}
node=${ORPHEUS_DRAIN_NODE_ID:-$(python3 -c 'import ray
ray.init(logging_level="error", log_to_driver=False)
print(ray.get_runtime_context().get_node_id())' 2>/dev/null | tail -n 1)}
if [ -z "${node}" ] || ! ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --node-id "${node}" \
        --reason-message "pod stopping: orpheus-ray-drain" --deadline-remaining-seconds "${seconds}"; then
    echo "orpheus-ray-drain: the drain was refused; stopping without it" >&2
    exit 0
fi
echo "orpheus-ray-drain: node draining; waiting up to ${seconds} s for its raylet to exit" >&2
end=$((SECONDS + seconds))
while [ "${SECONDS}" -lt "${end}" ] && grep -qsx raylet /proc/[0-9]*/comm; do  # no procps in Ray's image
    sleep 1
done
