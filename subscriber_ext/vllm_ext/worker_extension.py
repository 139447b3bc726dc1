"""vLLM worker extension: subscribe to a publisher and keep the seed's weight-sync API.

Use as ``worker_extension_cls=subscriber_ext.WORKER_EXTENSION`` (the string
``"subscriber_ext.worker_extension.BatchWeightSyncWorkerExtension"``). vLLM
mixes this class into its worker *after* the worker's own bases, so it may only
add names (vLLM asserts on a clash); everything here is prefixed ``_wp`` or is a
public RPC name. Each method runs on every rank through ``collective_rpc``,
between two steps (a worker serves RPCs and ``execute_model`` from one queue).

A version's way through a worker: the node's one ``WeightSubscriber`` (on the
first local rank to start, ``transport/node/node_join.py``) stages it in shared
memory and offers it to every local rank's ``CommitCoordinator`` (``commit/``), which
may prepare it off the step path (``apply/prepare.py``); the coordinator's
strategy decides when it is committed on every rank (the engine core with our
plugin, else the ranks' own agreement before ``execute_model``); the commit
applies it through vLLM's loaders (``apply/applier.py``) and reports back.
What a rank reports (status RPCs, the /metrics status file) is ``worker_status.py``.

Every public RPC is wrapped by ``rpc_replies.all_ranks_reply``: at TP/PP > 1 a
failure is raised by the last rank only (naming every rank's error), so vLLM's
executor reads every rank's reply and the next RPC gets its own.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from typing import Any, Unpack

from subscriber_ext.transport.node.node_join import join_node_staging
from subscriber_ext.transport.subscriber import WeightSubscriber
from subscriber_ext.transport.subscriber_options import SubscriberOptions
from subscriber_ext.vllm_ext.apply.prepare import PreparedVersion
from subscriber_ext.vllm_ext.apply.prepare_budget import PrepareBudget
from subscriber_ext.vllm_ext.apply.progressive import VersionPrep
from subscriber_ext.vllm_ext.commit.coordinator import CommitCoordinator, StagedLike
from subscriber_ext.vllm_ext.commit.shared_slots import ENV, SlotTable, SlotWriter
from subscriber_ext.vllm_ext.commit.strategies import CommitStrategy, EngineDriven, RankAgreement
from subscriber_ext.vllm_ext.commit.vllm_patches import wrap_execute_model
from subscriber_ext.vllm_ext.lora.adapter_versions import adapter_version
from subscriber_ext.vllm_ext.lora.merged import AdapterMerger
from subscriber_ext.vllm_ext.lora.served import AdapterServer, lora_manager_of
from subscriber_ext.vllm_ext.receive_choice import AUTO_PENDING
from subscriber_ext.vllm_ext.rpc_replies import all_ranks_reply
from subscriber_ext.vllm_ext.seed_rpcs import SeedRpcs
from subscriber_ext.vllm_ext.slice_receiver import SliceReceiver
from subscriber_ext.vllm_ext.slice_rpcs import SliceRpcs
from subscriber_ext.vllm_ext.vllm_compat import check_vllm
from subscriber_ext.vllm_ext.worker_options import WorkerKeywords, WorkerOptions
from subscriber_ext.vllm_ext.worker_state import VersionSource
from subscriber_ext.vllm_ext.worker_status import WorkerStatus
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import ApplyError, ConfigError
from weightpub_wire.heap_trim import set_mmap_threshold

__all__ = ["BatchWeightSyncWorkerExtension"]

logger = logging.getLogger("weightpub.worker")


class BatchWeightSyncWorkerExtension(SeedRpcs, SliceRpcs, WorkerStatus):
    """Worker extension adding subscription, step-boundary commit and the seed API."""

    # ------------------------------------------------------------ internals
    def _wp_coordinator(self) -> CommitCoordinator:
        st = self._wp()
        if st.coordinator is None:
            settings = st.options.commit
            applier = self._wp_applier()
            strategy: CommitStrategy
            if st.slots is not None:
                strategy = EngineDriven(SlotWriter(st.slots, st.slot_index))
            else:
                strategy = RankAgreement(self._wp_groups(), settings.keep)
            applier.prepare_budget = PrepareBudget(settings.prepare_budget_bytes)
            prepare = settings.prepare if settings.prepare is not None else \
                applier.mode() == "reload"
            prepare = prepare and applier.prepare_budget.enabled
            early = prepare and settings.prepare_while_arriving
            st.coordinator = CommitCoordinator(
                applier.apply, strategy, keep=settings.keep,
                on_commit=self._wp_report_applied, on_failure=self._wp_report_failed,
                prepare=self._wp_prepare if prepare else None,
                apply_prepared=applier.swap if prepare else None,
                prepare_policy="always" if settings.prepare else "auto",
                start_progressive=self._wp_start_progressive if early else None,
                trim_heap=settings.trim_heap,
                apply_adapters=self._wp_apply_adapters,
            )
        return st.coordinator

    def _wp_apply_adapters(self, staged: StagedLike) -> None:
        """Commit (every rank, one step): a version of LoRA adapters, served by name or
        merged into the base weights (``lora/``; ``lora_mode``)."""
        adapters = adapter_version(staged)
        assert adapters, "the coordinator sends adapter versions only"
        st = self._wp()
        mode = st.options.lora_mode
        manager = lora_manager_of(self.model_runner)
        if mode == "auto":
            mode = "serve" if manager is not None else "merge"
        if mode == "serve":
            if manager is None:
                raise ApplyError("lora_mode 'serve': this engine was started without "
                                 "enable_lora; start it with LoRA or use lora_mode 'merge'")
            if st.adapter_server is None:
                st.adapter_server = AdapterServer(manager)
            st.adapter_server.apply(adapters)
            st.adapter_mode = "serve"
            return
        applier = self._wp_applier()  # a new one when apply_mode changed
        merger = st.adapter_merger
        if merger is None or merger.adapter != st.options.merge_adapter \
                or merger.applier is not applier:
            st.adapter_merger = AdapterMerger(applier,
                                              self.vllm_config.model_config.model,
                                              st.options.merge_adapter)
        assert st.adapter_merger is not None
        st.adapter_merger.apply(adapters)
        st.adapter_mode = "merge"

    def _wp_configure(self, options: WorkerOptions) -> None:
        """Take ``options``; an applier or coordinator built with other settings goes."""
        st = self._wp()
        if options.apply_mode != st.options.apply_mode:
            st.applier = None
        if st.coordinator is not None and options.commit != st.options.commit:
            st.coordinator.close()
            st.coordinator = None
        st.options = options
        self._wp_coordinator()

    def _wp_prepare(self, staged: StagedLike) -> PreparedVersion:
        """Preparer thread: kernel-format shadows of ``staged`` (see ``apply/prepare.py``)."""
        return self._wp_applier().prepare(
            staged.tensors, version=staged.version, publisher_id=staged.publisher_id
        )

    def _wp_start_progressive(self, partial: Any) -> VersionPrep | None:
        """Preparer thread: plan a version still arriving, layer by layer (``progressive``)."""
        entries = [(e.name, e.dtype, tuple(e.shape)) for e in partial.manifest.tensors]
        return self._wp_applier().start_progressive(
            entries, version=partial.version, publisher_id=partial.publisher_id)

    def _wp_on_progress(self, partial: Any) -> None:
        """Transport thread: part of a version is final; its layers may be prepared now."""
        coordinator = self._wp().coordinator
        if coordinator is not None:
            coordinator.progress(partial)

    def _wp_on_version(self, staged: StagedLike) -> None:
        """Subscriber thread: a complete, verified version arrived for this rank."""
        st = self._wp()
        fetch_seconds = getattr(staged, "fetch_seconds", None)
        if isinstance(fetch_seconds, float):
            st.metrics.observe("transfer_seconds", fetch_seconds)
        if st.coordinator is not None:
            st.coordinator.offer(staged)

    def _wp_report_applied(self, version: int) -> None:
        """Back-channel: tell the publisher this rank now runs ``version``."""
        st = self._wp()
        if st.coordinator is not None and st.coordinator.commit_log:
            entry = st.coordinator.commit_log[-1]
            st.metrics.committed(entry["seconds"])
            st.metrics.observe("apply_seconds", entry["apply_seconds"])
        if st.source is not None:
            st.source.mark_applied(version)

    def _wp_report_failed(self, version: int, error: Exception) -> None:
        st = self._wp()
        st.metrics.failed(type(error).__name__)
        if st.source is not None:
            st.source.mark_applied(0, f"version {version}: {error}")

    def _wp_started(self) -> None:
        """Once per worker, after vLLM loaded the model (``vllm_patches`` hook 2)."""
        self._wp_attach_slots()
        self._wp_start_status_writer()
        self._wp_autostart()

    def _wp_attach_slots(self) -> None:
        """Map the engine core's slot table (``WEIGHTPUB_SLOTS``), if the plugin made one.

        Called once at init, while the engine that spawned us is still constructing,
        so the variable names *our* engine's table even if the process hosts several.
        """
        st = self._wp()
        value = os.environ.get(ENV)
        if not value or st.slots is not None:
            return
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            tp = get_tp_group()
            index = get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group
            table = SlotTable.from_env(value)
            if table is None or index >= table.nslots:
                raise ValueError(f"rank index {index} does not fit {value!r}")
        except (OSError, ValueError) as exc:
            logger.warning("weightpub: engine-driven commit unavailable (%s); ranks agree "
                           "among themselves", exc)
            return
        st.slots, st.slot_index = table, index

    def _wp_before_step(self, scheduler_output: Any) -> None:
        st = self._wp()
        t0 = time.perf_counter()
        if st.seed_pending:
            self._wp_flush_seed()
        coord = st.coordinator
        if coord is not None:
            coord.before_step()
            if st.options.record_requests:
                st.record_step(scheduler_output, coord.applied_version)
        st.step_check_s += time.perf_counter() - t0

    def _wp_autostart(self) -> None:
        """Start the subscriber named in ``additional_config["weightpub"]``, if any."""
        extra = getattr(self.vllm_config, "additional_config", None) or {}
        cfg = extra.get("weightpub") if isinstance(extra, dict) else None
        if not cfg:
            return
        if not isinstance(cfg, dict) or not isinstance(cfg.get("endpoint"), str):
            raise ConfigError("additional_config.weightpub.endpoint: expected a string")
        options = {k: v for k, v in cfg.items() if k != "endpoint"}
        # from a file or the command line: checked like init_info (no Python-only option)
        WorkerOptions.from_wire(options, "additional_config.weightpub")
        self.start_weight_subscriber(cfg["endpoint"], **options)

    def _wp_source_class(self, qualname: str) -> Any:
        module_name, _, cls_name = qualname.partition(":")
        try:
            return getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"subscriber_cls: cannot import {qualname!r}") from exc

    # --------------------------------------------------------- subscription
    @all_ranks_reply
    def start_weight_subscriber(self, endpoint: str,
                                **options: Unpack[WorkerKeywords]) -> dict[str, Any]:
        """Subscribe this rank to ``endpoint``; idempotent for the same endpoint.

        Extension options: ``apply_mode`` (auto|in_place|reload), ``keep`` (staged
        versions held per rank, default 2), ``prepare`` (build kernel-format weights
        on a background thread and only swap them in at commit; on in reload mode
        while the engine is busy when a prepare budget allows it, off while it is
        idle, where a direct reload is sooner; ``True`` always; costs up to one
        extra copy of the weights per rank), ``prepare_budget_bytes`` (what those
        shadows may hold per rank: default 0, none, so a replica following versions
        holds the staged copy and little else and each commit writes the staged bytes
        into the live weights, a longer pause; raise it to prepare that many bytes of
        layers off the step path, the rest written at the commit; unbounded by default
        with ``prepare=True``; shown in ``weight_status()["prepare_budget"]``),
        ``trim_heap`` (default True: after each commit a thread gives the heap memory
        it freed back to the OS, glibc's ``malloc_trim``; ``weight_status()["heap_trim"]``),
        ``mmap_threshold_bytes`` (default None; e.g. 1 MiB: fix glibc's mmap threshold in
        this worker so layer-sized blocks a commit frees go back to the OS at once: a lower
        peak, page faults on fresh large blocks; docs/benchmarks.md),
        ``subscriber_cls``
        ("module:Class" of a ``VersionSource``, default ``WeightSubscriber``; called
        as ``cls(endpoint, on_version=..., options=SubscriberOptions)``; Python only:
        refused from ``init_info`` and ``--additional-config``, so nothing is imported by
        a name that came over the network),
        ``prepare_while_arriving`` (default True: with ``prepare`` on, each layer is
        prepared as soon as its bytes are verified, while later layers are still on
        the wire, busy engine or idle; the commit then only swaps),
        ``record_requests``, ``request_log_size``, ``node_staging`` (default: on when
        the replica has more than one rank: the ranks of this replica on one node
        share one subscription and one staged copy in shared memory; a single-rank
        replica keeps private, on CUDA pinned, staging; True/False force it), ``receive``
        (``auto`` by default: at more than one rank, each rank runs its own subscriber that
        fetches only the bytes its weight loaders read, its slice plan, when every rank
        needs below 0.9x of a version, else whole versions as ``node_staging`` says;
        ``slices`` / ``whole`` force it; without a local checkpoint's layout ``auto``
        decides at the first version, once; ``weight_status()["receive"]`` says which and
        why, this rank's planned share and what its applied version cost it
        (``receive_table.py``), ``["subscriber"]["slices"]`` this rank's plan;
        ``receive_choice.py``).
        Everything else is the subscriber's (``WeightSubscriber``'s keywords, e.g.
        ``staging_budget_bytes``, or ``collective=True``: the node joins the
        publisher's collective data path, gloo on CPUs, NCCL / CUDA IPC on this rank's
        GPU; ``weight_version()``'s ``data_path`` then says which path brought the
        applied version). All are checked at once (``WorkerOptions``), on every rank.
        """
        check_vllm()
        wanted = WorkerOptions.from_keywords(**options)  # the same error on every rank
        st = self._wp()
        with st.lock:
            if st.source is not None:
                if st.endpoint == endpoint:
                    return self._wp_status()
                self.stop_weight_subscriber()
            self._wp_configure(wanted)
            if wanted.mmap_threshold_bytes is not None and \
                    not set_mmap_threshold(wanted.mmap_threshold_bytes):
                logger.warning("weightpub: mmap_threshold_bytes ignored (not glibc)")
            self._wp_start_status_writer()
            if not st.hooked:
                wrap_execute_model(self, self._wp_before_step)
                st.hooked = True
            st.source = self._wp_subscribe(endpoint, wanted)
            st.endpoint = endpoint
            logger.info("weightpub: rank %s subscribed to %s", self.rank, endpoint)
        return self._wp_status()

    def _wp_subscribe(self, endpoint: str, options: WorkerOptions) -> VersionSource:
        """This rank's source: its own slices, the node's shared subscription, its own
        whole one, or a stand-in (``receive_choice.py`` says which and why)."""
        cls = self._wp_source_class(options.subscriber_cls)
        if cls is not WeightSubscriber:
            source = cls(endpoint, on_version=self._wp_on_version, options=options.subscriber)
            if not isinstance(source, VersionSource):
                source.close()
                raise ConfigError(f"subscriber_cls: {cls.__name__} lacks status/mark_applied/"
                                  "close")
            return source
        parse_endpoint(endpoint)  # here too on followers, which start no subscriber
        sub = self._wp_subscriber_options(options.subscriber)
        choice, layout = self._wp_choose_receive(options)
        self._wp().receive = choice
        pending = choice.cause == AUTO_PENDING  # decides at the first version, once
        if choice.mode == "slices" or pending:
            return SliceReceiver(endpoint, rank=self.rank, label=self._wp_slice_label(),
                                 options=sub, plan_for=self._wp_plan_for,
                                 on_version=self._wp_on_version,
                                 on_progress=self._wp_on_progress, layout=layout,
                                 decide=self._wp_decide_receive if pending else None)
        node_key = self._wp_node_key(endpoint) if choice.mode == "node" else None
        if node_key is not None:
            return join_node_staging(
                node_key, rank=self.rank, on_version=self._wp_on_version,
                on_progress=self._wp_on_progress,
                subscribe=lambda on_version, allocator, **more: WeightSubscriber(
                    endpoint, options=sub, on_version=on_version, allocator=allocator,
                    **more))
        subscriber = WeightSubscriber(endpoint, options=sub, on_version=self._wp_on_version,
                                      on_progress=self._wp_on_progress)  # sees arrivals
        subscriber.set_ranks((self.rank,))
        return subscriber

    def _wp_subscriber_options(self, options: SubscriberOptions) -> SubscriberOptions:
        """This rank's defaults: an id naming host, process and rank; the rank's GPU for a
        collective path."""
        changes: dict[str, Any] = {"subscriber_id": options.subscriber_id or
                                   f"{socket.gethostname()}-{os.getpid()}-rank{self.rank}"}
        if options.collective and options.collective_device is None and \
                getattr(self.device, "type", "") == "cuda":
            changes["collective_device"] = str(self.device)
        return options.replace(**changes)

    def _wp_node_key(self, endpoint: str) -> str | None:
        """What every local rank of this replica (and no other replica) shares: vLLM's
        rendezvous address for this engine's ranks, and the endpoint followed."""
        rendezvous = getattr(self, "distributed_init_method", None)
        if not rendezvous:
            logger.warning("weightpub: no distributed_init_method; each rank subscribes alone")
            return None
        return f"{rendezvous}|{endpoint}"

    @all_ranks_reply
    def stop_weight_subscriber(self) -> None:
        """Close the subscriber; staged but uncommitted versions are dropped."""
        st = self._wp()
        with st.lock:
            if st.source is not None:
                try:
                    st.source.close()
                finally:
                    st.source = None
                    st.endpoint = None
            if st.coordinator is not None:
                st.coordinator.drop_staged()

    @all_ranks_reply
    def commit_pending(self) -> int | None:
        """Make the newest version every rank holds live now; returns this rank's version.

        With the engine plugin the engine core has already committed before this RPC
        reached the workers; without it the ranks agree here (a collective at TP>1).
        """
        st = self._wp()
        if st.seed_pending:
            self._wp_flush_seed()
        if st.coordinator is None:
            return None
        return st.coordinator.commit_pending()

    @all_ranks_reply
    def weightpub_commit_version(self, version: int, publisher_hash: int) -> int | None:
        """Engine-driver RPC (``engine_driver.COMMIT_RPC``): commit exactly ``version`` here."""
        st = self._wp()
        if st.coordinator is None:
            return None
        return st.coordinator.commit(int(version), int(publisher_hash))

    @all_ranks_reply
    def weight_version(self) -> dict[str, Any]:
        """Commit what is pending, then report this rank's state."""
        self.commit_pending()
        return self._wp_status()

    @all_ranks_reply
    def weight_status(self) -> dict[str, Any]:
        """Report this rank's state without committing anything."""
        return self._wp_status()

    @all_ranks_reply
    def weight_request_versions(self, req_ids: list[str] | None = None) -> dict[str, list]:
        """``req_id -> [first, last]`` applied version of the steps that ran it."""
        reqs = self._wp().requests
        if req_ids is None:
            return {k: list(v) for k, v in reqs.items()}
        return {k: list(reqs[k]) for k in req_ids if k in reqs}

