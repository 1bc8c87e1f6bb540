# The two set-up commands of the README: `make demo` and `make test`.
# Each installs what is missing into .venv first. torch is pinned to the CPU build here only, with
# the torchvision of its release (timm's, for the framework tests: a newer one would pull a newer
# torch); pyproject.toml keeps the loose range users need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.distckpt-installed
# Azure Blob's emulator, from the npm registry, for the storage tests
AZURITE_VERSION := 3.37.0

.PHONY: install demo demo-s3 compose-demo compose-demo-memory test test-faults test-gpu bench bench-cluster docs clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 torchvision==0.28.0
	$(PY) -m pip install --quiet -e '.[test,s3,data,docs]'
	test -x $(VENV)/azurite/node_modules/.bin/azurite-blob || npm install --silent --no-audit --no-fund \
		--prefix $(VENV)/azurite azurite@$(AZURITE_VERSION)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) launch/demo.py

demo-s3: $(STAMP)
	$(PY) launch/demo.py --s3

# docker/compose.yaml for real: S3 + 2 nodes x 2 ranks in containers, node 1's container killed
# after a checkpoint is committed, the job restarted, every loss compared with an uninterrupted
# run (docs/guides/compose-cluster.md). Needs docker and compose, not .venv: the host's python3 only
# drives it. As root it starts dockerd, and without a registry debootstraps the base image.
compose-demo:
	$(PYTHON) launch/compose_demo.py

# The same cluster with the memory tier (docker/compose.memory.yaml): node 1's machine killed and
# replaced by a fresh container with an empty /dev/shm, the job restarted on both nodes; it must
# resume from node 0's partner copy (the peer tier) with every loss bitwise equal, reading no byte
# of the step from S3 (counted at the S3 service by launch/s3count.py) (docs/guides/compose-cluster.md).
compose-demo-memory:
	$(PYTHON) launch/compose_demo.py --memory-tier

test: $(STAMP)
	$(PY) -m pytest -q --durations=40

# The fault tests with their whole matrices (make test runs a sample of the long ones: the loop
# zoo's marked cases, 6-60 generated examples per property); each trial prints one line.
FAULT_TESTS = tests/protocol/test_load_memory.py tests/resume/test_loop_zoo.py tests/frameworks/test_accelerate.py tests/frameworks/test_hf_trainer.py tests/frameworks/test_fabric.py tests/frameworks/test_timm.py tests/resume/test_outside_state.py tests/tools/test_doctor.py tests/tools/test_doctor_compare.py tests/protocol/test_tiers.py tests/tools/test_weights.py tests/protocol/test_incremental.py \
	tests/unit/test_roundtrip_property.py tests/unit/test_hostile_corpus.py tests/protocol/test_overlap.py tests/storage/test_s3_reads.py tests/storage/test_object_stores.py tests/storage/test_storage_contract.py \
	tests/protocol/test_no_half_restore.py tests/resume/test_loop_patterns.py tests/protocol/test_crash_matrix.py tests/storage/test_powercut.py tests/storage/test_s3_faults.py tests/storage/test_damage.py \
	tests/protocol/test_memory_tier.py tests/protocol/test_memory_only_saves.py tests/distributed/test_memory_tier_nodes.py \
	tests/protocol/test_fencing.py tests/protocol/test_writer_process.py tests/protocol/test_staging_bound.py tests/unit/test_hostile.py tests/distributed/test_distributed.py tests/distributed/test_preemption.py tests/distributed/test_sharded.py \
	tests/resume/test_exact_resume.py tests/storage/test_s3.py tests/distributed/test_cluster.py tests/distributed/test_cluster_bench.py tests/storage/test_concurrent_readers.py tests/tools/test_cli_people.py tests/protocol/test_interrupts.py tests/distributed/test_preemption_unit.py \
	tests/protocol/test_manager_local.py::test_a_full_disk_at_every_write_never_damages_the_previous_checkpoint \
	tests/protocol/test_manager_local.py::test_an_io_error_at_every_fsync_rename_and_link_keeps_the_previous_checkpoint \
	tests/resume/test_elastic.py tests/tools/test_doctor_resize.py tests/unit/test_elastic_order.py
test-faults: $(STAMP)
	DISTCKPT_HYPOTHESIS_EXAMPLES=300 $(PY) -m pytest -q -s -m "faults or not faults" $(FAULT_TESTS)

bench: $(STAMP)
	$(PY) bench/run.py

# Save and load on a simulated cluster of 1, 2 and 4 nodes (network namespaces, each node's link to
# SeaweedFS shaped with tc), now and before; the table into docs/benchmarks/cluster.md. As root;
# about 7 minutes (436 s on a 2-core machine).
bench-cluster: $(STAMP)
	$(PY) bench/cluster.py --docs

# The documentation site (mkdocs.yml, docs/): every link, anchor and API reference checked.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict -d build/site

# On a machine with CUDA: the GPU tests and the GPU benchmarks, logs under build/gpu (the
# system's python3, which holds the CUDA build of torch; torchdata as wheels under .whl/ if absent).
test-gpu:
	bash tests/gpu/device_check.sh build/gpu

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
