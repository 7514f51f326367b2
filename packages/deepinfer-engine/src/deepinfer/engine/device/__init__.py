"""Host-device plumbing shared by sampling and the step: staged host-to-device copies through pinned
memory (`staging`) and the guard that fails a step which would synchronise with the GPU (`sync_guard`).
"""
