//! Tests of the record differ, driven by hand-built listings and watch events in Dynamo's
//! record shapes (dynamo-live §9.1, dc-inputs §1.3).

use std::collections::BTreeSet;

use super::records::{
    ChannelChange, DiscoveryOutput, EntryValue, KeyForm, ListingEntry, ListingMode, RecordDiffer,
};
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::{
    CardInstanceId, DcInput, EndpointInstances, EventRecordKey, InputError, InputErrorKind,
};
use kvrelay_core::model::identity::EndpointPath;

const WORKER_A: u64 = 0xc068_c014_57d2_3c43;
const WORKER_B: u64 = 0xdc71_242a_fcad_0e39;
const PUBLISHER_A: u64 = 0x1a_0878_c30c_67ae;
const PUBLISHER_B: u64 = 0x1b_be13_eb67_504f;

fn backend() -> EndpointPath {
    EndpointPath::new("dynamo", "backend", "generate").unwrap()
}

fn prefill() -> EndpointPath {
    EndpointPath::new("dynamo", "prefill", "generate").unwrap()
}

fn differ() -> RecordDiffer {
    RecordDiffer::new(DiscoveryScope::watch_all(Vec::new()).unwrap(), KeyForm::Logical)
}

fn instance_key(endpoint: &EndpointPath, instance: u64) -> String {
    format!("v1/instances/{endpoint}/{instance:x}")
}

fn instance_json(endpoint: &EndpointPath, instance: u64) -> Vec<u8> {
    format!(
        r#"{{"type":"Endpoint","component":"{c}","endpoint":"{e}","namespace":"{n}",
        "instance_id":{instance},"transport":{{"tcp":"127.0.0.1:34229/{instance:x}/{n}/{c}/{e}"}},
        "device_type":"cuda","request_plane_codec":"msgpack"}}"#,
        n = endpoint.namespace(),
        c = endpoint.component(),
        e = endpoint.endpoint()
    )
    .into_bytes()
}

fn card_key(endpoint: &EndpointPath, instance: u64, suffix: Option<&str>) -> String {
    match suffix {
        Some(suffix) => format!("v1/mdc/{endpoint}/{instance:x}/{suffix}"),
        None => format!("v1/mdc/{endpoint}/{instance:x}"),
    }
}

/// A Model record around an aggregated `tiny-llm` card; `taints` and `blocks` vary it.
fn card_json(
    endpoint: &EndpointPath,
    instance: u64,
    suffix: Option<&str>,
    blocks: u64,
    taints: &str,
) -> Vec<u8> {
    let (suffix_field, lora) = match suffix {
        Some(suffix) => (
            format!(r#""model_suffix":"{suffix}","#),
            format!(r#""lora":{{"name":"{suffix}","max_gpu_lora_count":4}},"#),
        ),
        None => (String::new(), String::new()),
    };
    format!(
        r#"{{"type":"Model","namespace":"{n}","component":"{c}","endpoint":"{e}",
        "instance_id":{instance},{suffix_field}
        "card_json":{{"display_name":"tiny-llm","slug":"tiny-llm",
          "source_path":"/tmp/dynlive/models/tiny-llm","kv_cache_block_size":16,
          "context_length":8192,"model_type":"Chat | Completions","model_input":"Tokens",
          "worker_type":"aggregated","needs":[],{lora}
          "runtime_config":{{"total_kv_blocks":{blocks},"max_num_seqs":256,
            "max_num_batched_tokens":8192,"data_parallel_start_rank":0,"data_parallel_size":1,
            "enable_local_indexer":false,"kv_event_publishing_enabled":true,
            "enable_eagle":false{taints}}}}}}}"#,
        n = endpoint.namespace(),
        c = endpoint.component(),
        e = endpoint.endpoint()
    )
    .into_bytes()
}

fn source_key(endpoint: &EndpointPath, publisher: u64) -> String {
    format!(
        "v1/event_sources/namespace/{}/component/{}/endpoint/{}/topic/kv-events/{publisher:x}",
        endpoint.namespace(),
        endpoint.component(),
        endpoint.endpoint()
    )
}

fn source_json(endpoint: &EndpointPath, worker: u64, publisher: u64, dp_rank: u32) -> Vec<u8> {
    let scope = format!(
        r#"{{"namespace":"{}","component":"{}","name":"{}"}}"#,
        endpoint.namespace(),
        endpoint.component(),
        endpoint.endpoint()
    );
    format!(
        r#"{{"type":"EventSource","scope":{{"kind":"endpoint","endpoint":{scope}}},
        "topic":"kv-events","publisher_id":{publisher},
        "metadata":{{"kv_state_endpoint":{scope},"worker":{{"worker_id":{worker},"dp_rank":{dp_rank}}},
          "publisher_id":{publisher}}}}}"#
    )
    .into_bytes()
}

fn channel_key(endpoint: &EndpointPath, topic: &str, publisher: u64) -> String {
    format!(
        "v1/event_channels/namespace/{}/component/{}/endpoint/{}/topic/{topic}/{publisher:x}",
        endpoint.namespace(),
        endpoint.component(),
        endpoint.endpoint()
    )
}

fn channel_json(endpoint: &EndpointPath, topic: &str, publisher: u64) -> Vec<u8> {
    format!(
        r#"{{"type":"EventChannel","scope":{{"kind":"endpoint","endpoint":{{"namespace":"{n}",
        "component":"{c}","name":"{e}"}}}},"topic":"{topic}","instance_id":{publisher},
        "transport":{{"kind":"Nats","config":{{"subject_prefix":"namespace.{n}.component.{c}.endpoint.{e}"}}}}}}"#,
        n = endpoint.namespace(),
        c = endpoint.component(),
        e = endpoint.endpoint()
    )
    .into_bytes()
}

/// The five keys one aggregated worker registers.
fn worker(endpoint: &EndpointPath, instance: u64, publisher: u64) -> Vec<ListingEntry> {
    vec![
        ListingEntry::bytes(instance_key(endpoint, instance), instance_json(endpoint, instance)),
        ListingEntry::bytes(
            card_key(endpoint, instance, None),
            card_json(endpoint, instance, None, 16384, ""),
        ),
        ListingEntry::bytes(
            source_key(endpoint, publisher),
            source_json(endpoint, instance, publisher, 0),
        ),
        ListingEntry::bytes(
            channel_key(endpoint, "kv-events", publisher),
            channel_json(endpoint, "kv-events", publisher),
        ),
        ListingEntry::bytes(
            channel_key(endpoint, "kv_metrics", publisher),
            channel_json(endpoint, "kv_metrics", publisher),
        ),
    ]
}

fn card_id(endpoint: &EndpointPath, instance: u64, suffix: Option<&str>) -> CardInstanceId {
    CardInstanceId {
        endpoint: endpoint.clone(),
        instance_id: instance,
        model_suffix: suffix.map(str::to_owned),
    }
}

fn instances(endpoint: &EndpointPath, live: &[u64]) -> DiscoveryOutput {
    DiscoveryOutput::Fact(DcInput::Instances(EndpointInstances {
        endpoint: endpoint.clone(),
        live_workers: Some(live.iter().copied().collect::<BTreeSet<_>>()),
    }))
}

/// A compact rendering of outputs, so expectations read as a story.
fn summary(outputs: &[DiscoveryOutput]) -> Vec<String> {
    outputs
        .iter()
        .map(|output| match output {
            DiscoveryOutput::Fact(DcInput::CardsListed { cards }) => {
                let ids: Vec<String> =
                    cards.iter().map(|(id, _)| format!("{:x}", id.instance_id)).collect();
                format!("listed[{}]", ids.join(","))
            }
            DiscoveryOutput::Fact(DcInput::CardUpserted { id, .. }) => {
                format!("upsert {} {:x} {:?}", id.endpoint, id.instance_id, id.model_suffix)
            }
            DiscoveryOutput::Fact(DcInput::CardRemoved { id }) => {
                format!("remove {} {:x} {:?}", id.endpoint, id.instance_id, id.model_suffix)
            }
            DiscoveryOutput::Fact(DcInput::CardTaintsUpdated { id, taints_json }) => {
                format!("taints {:x} {taints_json:?}", id.instance_id)
            }
            DiscoveryOutput::Fact(DcInput::Instances(instances)) => {
                let live: Option<Vec<String>> = instances
                    .live_workers
                    .as_ref()
                    .map(|set| set.iter().map(|id| format!("{id:x}")).collect());
                format!("instances {} {live:?}", instances.endpoint)
            }
            DiscoveryOutput::Fact(DcInput::SourceAdvertised(advert)) => format!(
                "advertise {} {:x} worker {:x}/{}",
                advert.kv_state_endpoint,
                advert.publisher_id,
                advert.source.worker_id,
                advert.source.dp_rank
            ),
            DiscoveryOutput::Fact(DcInput::SourceWithdrawn { kv_state_endpoint, publisher_id }) => {
                format!("withdraw {kv_state_endpoint} {publisher_id:x}")
            }
            DiscoveryOutput::Channel(ChannelChange::Upsert(channel)) => {
                format!("channel+ {} {} {:x}", channel.scope, channel.topic, channel.publisher_id)
            }
            DiscoveryOutput::Channel(ChannelChange::Remove(key)) => {
                format!("channel- {} {} {:x}", key.scope, key.topic, key.publisher_id)
            }
            other => format!("{other:?}"),
        })
        .collect()
}

#[test]
fn first_listing_reports_the_whole_deployment_authoritatively() {
    let mut differ = differ();
    let mut entries = worker(&backend(), WORKER_A, PUBLISHER_A);
    entries.extend(worker(&prefill(), WORKER_B, PUBLISHER_B));
    entries.reverse(); // order of arrival does not matter
    let outputs = differ.apply_listing(entries, ListingMode::Poll);
    assert_eq!(
        summary(&outputs),
        vec![
            "listed[c068c01457d23c43,dc71242afcad0e39]",
            "instances dynamo/backend/generate Some([\"c068c01457d23c43\"])",
            "instances dynamo/prefill/generate Some([\"dc71242afcad0e39\"])",
            "advertise dynamo/backend/generate 1a0878c30c67ae worker c068c01457d23c43/0",
            "advertise dynamo/prefill/generate 1bbe13eb67504f worker dc71242afcad0e39/0",
            "channel+ dynamo/backend/generate kv-events 1a0878c30c67ae",
            "channel+ dynamo/backend/generate kv_metrics 1a0878c30c67ae",
            "channel+ dynamo/prefill/generate kv-events 1bbe13eb67504f",
            "channel+ dynamo/prefill/generate kv_metrics 1bbe13eb67504f",
        ]
    );
    assert!(differ.is_listed());
    assert_eq!(differ.key_count(), 10);
    assert_eq!(differ.counters().accepted(), 10);
    let DiscoveryOutput::Fact(DcInput::CardsListed { cards }) = &outputs[0] else {
        panic!("not a listing")
    };
    assert_eq!(cards[0].1.display_name, "tiny-llm");
    assert_eq!(cards[0].1.runtime_config.total_kv_blocks, Some(16384));
}

#[test]
fn an_empty_first_listing_still_reports_an_empty_card_set() {
    let mut differ = differ();
    let outputs = differ.apply_listing(Vec::new(), ListingMode::Relist);
    assert_eq!(summary(&outputs), vec!["listed[]"]);
    // Nothing changed since: nothing to say, whatever the mode.
    assert!(differ.apply_listing(Vec::new(), ListingMode::Relist).is_empty());
    assert!(differ.apply_listing(Vec::new(), ListingMode::Poll).is_empty());
}

#[test]
fn instance_sets_are_withheld_until_the_first_listing() {
    let mut differ = differ();
    let before =
        differ.apply_put(&instance_key(&backend(), WORKER_A), instance_json(&backend(), WORKER_A));
    assert!(before.is_empty(), "{before:?}");
    let card = differ.apply_put(
        &card_key(&backend(), WORKER_A, None),
        card_json(&backend(), WORKER_A, None, 16384, ""),
    );
    assert_eq!(summary(&card), vec!["upsert dynamo/backend/generate c068c01457d23c43 None"]);
    // The listing (which still holds both keys) makes availability authoritative.
    let listing = differ.apply_listing(
        worker(&backend(), WORKER_A, PUBLISHER_A).into_iter().take(2).collect(),
        ListingMode::Relist,
    );
    assert_eq!(listing[1], instances(&backend(), &[WORKER_A]));
}

#[test]
fn records_added_after_the_listing_are_reported_one_by_one() {
    let mut differ = differ();
    differ.apply_listing(worker(&backend(), WORKER_A, PUBLISHER_A), ListingMode::Relist);
    let mut outputs = Vec::new();
    for entry in worker(&backend(), WORKER_B, PUBLISHER_B) {
        let EntryValue::Bytes(bytes) = entry.value else { unreachable!() };
        outputs.extend(differ.apply_put(&entry.key, bytes));
    }
    assert_eq!(
        summary(&outputs),
        vec![
            "instances dynamo/backend/generate Some([\"c068c01457d23c43\", \"dc71242afcad0e39\"])",
            "upsert dynamo/backend/generate dc71242afcad0e39 None",
            "advertise dynamo/backend/generate 1bbe13eb67504f worker dc71242afcad0e39/0",
            "channel+ dynamo/backend/generate kv-events 1bbe13eb67504f",
            "channel+ dynamo/backend/generate kv_metrics 1bbe13eb67504f",
        ]
    );
    // An adapter card on the same worker is its own card identity.
    let adapter = differ.apply_put(
        &card_key(&backend(), WORKER_B, Some("ad-1")),
        card_json(&backend(), WORKER_B, Some("ad-1"), 16384, ""),
    );
    assert_eq!(
        summary(&adapter),
        vec!["upsert dynamo/backend/generate dc71242afcad0e39 Some(\"ad-1\")"]
    );
}

#[test]
fn a_changed_card_is_upserted_and_a_taint_only_change_is_a_taint_update() {
    let mut differ = differ();
    differ.apply_listing(worker(&backend(), WORKER_A, PUBLISHER_A), ListingMode::Poll);
    let key = card_key(&backend(), WORKER_A, None);
    let same = differ.apply_put(&key, card_json(&backend(), WORKER_A, None, 16384, ""));
    assert!(same.is_empty());
    let tainted = differ.apply_put(
        &key,
        card_json(
            &backend(),
            WORKER_A,
            None,
            16384,
            r#","taints":[{"key":"gpu","value":"b","effect":"NoSchedule"}]"#,
        ),
    );
    assert_eq!(
        tainted,
        vec![DiscoveryOutput::Fact(DcInput::CardTaintsUpdated {
            id: card_id(&backend(), WORKER_A, None),
            taints_json: Some(r#"[{"effect":"NoSchedule","key":"gpu","value":"b"}]"#.into()),
        })]
    );
    let resized = differ.apply_put(&key, card_json(&backend(), WORKER_A, None, 8192, ""));
    let [DiscoveryOutput::Fact(DcInput::CardUpserted { id, card })] = resized.as_slice() else {
        panic!("expected one upsert, got {resized:?}")
    };
    assert_eq!(*id, card_id(&backend(), WORKER_A, None));
    assert_eq!(card.runtime_config.total_kv_blocks, Some(8192));
    assert_eq!(card.runtime_config.taints_json, None);
}

#[test]
fn deletes_remove_cards_sources_channels_and_empty_the_instance_set() {
    let mut differ = differ();
    let mut entries = worker(&backend(), WORKER_A, PUBLISHER_A);
    entries.extend(worker(&backend(), WORKER_B, PUBLISHER_B));
    differ.apply_listing(entries, ListingMode::Relist);
    let mut outputs = Vec::new();
    for key in [
        instance_key(&backend(), WORKER_A),
        card_key(&backend(), WORKER_A, None),
        source_key(&backend(), PUBLISHER_A),
        channel_key(&backend(), "kv-events", PUBLISHER_A),
    ] {
        outputs.extend(differ.apply_delete(&key));
    }
    assert_eq!(
        summary(&outputs),
        vec![
            "instances dynamo/backend/generate Some([\"dc71242afcad0e39\"])",
            "remove dynamo/backend/generate c068c01457d23c43 None",
            "withdraw dynamo/backend/generate 1a0878c30c67ae",
            "channel- dynamo/backend/generate kv-events 1a0878c30c67ae",
        ]
    );
    // The endpoint's last instance goes: an authoritative empty set, once.
    let last = differ.apply_delete(&instance_key(&backend(), WORKER_B));
    assert_eq!(last, vec![instances(&backend(), &[])]);
    assert!(differ.apply_delete(&instance_key(&backend(), WORKER_B)).is_empty());
    // Deleting keys the differ does not hold changes nothing.
    assert!(differ.apply_delete(&instance_key(&prefill(), WORKER_A)).is_empty());
    assert!(differ.apply_delete("v1/instances/not/a/key/zz").is_empty());
}

#[test]
fn an_endpoint_that_never_had_an_instance_is_never_announced() {
    let mut differ = differ();
    let card_only = vec![ListingEntry::bytes(
        card_key(&prefill(), WORKER_B, None),
        card_json(&prefill(), WORKER_B, None, 16384, ""),
    )];
    let outputs = differ.apply_listing(card_only, ListingMode::Relist);
    assert_eq!(summary(&outputs), vec!["listed[dc71242afcad0e39]"]);
}

#[test]
fn expiry_in_a_poll_removes_what_the_poll_no_longer_lists() {
    let mut differ = differ();
    let mut both = worker(&backend(), WORKER_A, PUBLISHER_A);
    both.extend(worker(&backend(), WORKER_B, PUBLISHER_B));
    differ.apply_listing(both, ListingMode::Poll);
    // Worker B's files expired (a poll leaves them out): removals one by one.
    let outputs =
        differ.apply_listing(worker(&backend(), WORKER_A, PUBLISHER_A), ListingMode::Poll);
    assert_eq!(
        summary(&outputs),
        vec![
            "remove dynamo/backend/generate dc71242afcad0e39 None",
            "instances dynamo/backend/generate Some([\"c068c01457d23c43\"])",
            "withdraw dynamo/backend/generate 1bbe13eb67504f",
            "channel- dynamo/backend/generate kv-events 1bbe13eb67504f",
            "channel- dynamo/backend/generate kv_metrics 1bbe13eb67504f",
        ]
    );
    // Then worker A's too: the endpoint is authoritatively empty.
    let outputs = differ.apply_listing(Vec::new(), ListingMode::Poll);
    assert_eq!(outputs[1], instances(&backend(), &[]));
}

#[test]
fn a_relist_reports_cards_as_one_listing_and_withdraws_vanished_keys() {
    let mut differ = differ();
    let mut both = worker(&backend(), WORKER_A, PUBLISHER_A);
    both.extend(worker(&prefill(), WORKER_B, PUBLISHER_B));
    differ.apply_listing(both, ListingMode::Relist);
    let outputs =
        differ.apply_listing(worker(&backend(), WORKER_A, PUBLISHER_A), ListingMode::Relist);
    assert_eq!(
        summary(&outputs),
        vec![
            "listed[c068c01457d23c43]",
            "instances dynamo/prefill/generate Some([])",
            "withdraw dynamo/prefill/generate 1bbe13eb67504f",
            "channel- dynamo/prefill/generate kv-events 1bbe13eb67504f",
            "channel- dynamo/prefill/generate kv_metrics 1bbe13eb67504f",
        ]
    );
    // An unchanged relist says nothing.
    assert!(
        differ
            .apply_listing(worker(&backend(), WORKER_A, PUBLISHER_A), ListingMode::Relist)
            .is_empty()
    );
}

#[test]
fn a_replaced_source_descriptor_is_withdrawn_before_it_is_advertised_again() {
    let mut differ = differ();
    differ.apply_listing(worker(&backend(), WORKER_A, PUBLISHER_A), ListingMode::Relist);
    let moved = differ.apply_put(
        &source_key(&backend(), PUBLISHER_A),
        source_json(&backend(), WORKER_A, PUBLISHER_A, 1),
    );
    assert_eq!(
        summary(&moved),
        vec![
            "withdraw dynamo/backend/generate 1a0878c30c67ae",
            "advertise dynamo/backend/generate 1a0878c30c67ae worker c068c01457d23c43/1",
        ]
    );
}

#[test]
fn malformed_records_are_counted_once_skipped_and_never_replace_a_good_record() {
    let mut differ = differ();
    let card = card_key(&backend(), WORKER_A, None);
    let mut entries = worker(&backend(), WORKER_A, PUBLISHER_A);
    entries.push(ListingEntry::bytes(
        card_key(&prefill(), WORKER_B, None),
        b"{\"type\":\"Mod".to_vec(),
    ));
    entries
        .push(ListingEntry::bytes("v1/instances/dynamo/backend/generate/not-hex", b"{}".to_vec()));
    entries.push(ListingEntry::bytes("v1/mdc/too/short", b"{}".to_vec()));
    // Keys of other subsystems sharing the store are not discovery records at all.
    entries.push(ListingEntry::bytes("v1/kv_routers/dynamo/x", b"{}".to_vec()));
    entries.push(ListingEntry::bytes("v2/elsewhere", b"{}".to_vec()));
    let outputs = differ.apply_listing(entries.clone(), ListingMode::Poll);
    assert_eq!(summary(&outputs)[0], "listed[c068c01457d23c43]");
    assert_eq!(differ.counters().rejected(InputErrorKind::Json), 1);
    assert_eq!(differ.counters().rejected(InputErrorKind::MalformedKey), 2);
    // The same bad values seen by the next poll are not counted again.
    assert!(differ.apply_listing(entries, ListingMode::Poll).is_empty());
    assert_eq!(differ.counters().rejected_total(), 3);

    // A torn write over a good card keeps the good card.
    assert!(differ.apply_put(&card, b"{\"type\":\"Model\",\"names".to_vec()).is_empty());
    assert_eq!(differ.counters().rejected(InputErrorKind::Json), 2);
    // Writing the good value back is "no change" for the consumer.
    assert!(differ.apply_put(&card, card_json(&backend(), WORKER_A, None, 16384, "")).is_empty());
    // A value the transport rejected (too large) is counted like a malformed one.
    let too_large = ListingEntry {
        key: card.clone(),
        value: EntryValue::Rejected(InputError::TooLarge {
            what: "discovery record",
            bytes: 5 << 20,
            max: 4 << 20,
        }),
    };
    let mut entries = worker(&backend(), WORKER_A, PUBLISHER_A);
    entries.retain(|entry| entry.key != card);
    entries.push(too_large);
    assert!(differ.apply_listing(entries, ListingMode::Poll).is_empty());
    assert_eq!(differ.counters().rejected(InputErrorKind::TooLarge), 1);
}

#[test]
fn an_unreadable_entry_keeps_what_its_key_held() {
    let mut differ = differ();
    differ.apply_listing(worker(&backend(), WORKER_A, PUBLISHER_A), ListingMode::Poll);
    let mut entries = worker(&backend(), WORKER_A, PUBLISHER_A);
    for entry in &mut entries {
        entry.value = EntryValue::Unreadable;
    }
    assert!(differ.apply_listing(entries, ListingMode::Poll).is_empty());
    assert_eq!(differ.key_count(), 5);
    assert_eq!(differ.counters().rejected_total(), 0);
}

#[test]
fn a_record_stored_under_another_key_is_rejected() {
    let mut differ = differ();
    let outputs = differ.apply_listing(
        vec![ListingEntry::bytes(
            instance_key(&backend(), WORKER_B),
            instance_json(&backend(), WORKER_A),
        )],
        ListingMode::Relist,
    );
    assert_eq!(summary(&outputs), vec!["listed[]"]);
    assert_eq!(differ.counters().rejected(InputErrorKind::MalformedKey), 1);
}

#[test]
fn scope_filters_cards_and_instances_by_endpoint_and_event_records_by_namespace() {
    let scope =
        DiscoveryScope::namespaces(vec!["dynamo".into()], vec!["dynamo.backend".into()]).unwrap();
    let mut differ = RecordDiffer::new(scope, KeyForm::Logical);
    let other_namespace = EndpointPath::new("staging", "backend", "generate").unwrap();
    let mut entries = worker(&backend(), WORKER_A, PUBLISHER_A);
    entries.extend(worker(&prefill(), WORKER_B, PUBLISHER_B));
    entries.extend(worker(&other_namespace, WORKER_B, 7));
    let outputs = differ.apply_listing(entries, ListingMode::Relist);
    assert_eq!(
        summary(&outputs),
        vec![
            "listed[c068c01457d23c43]",
            "instances dynamo/backend/generate Some([\"c068c01457d23c43\"])",
            "advertise dynamo/backend/generate 1a0878c30c67ae worker c068c01457d23c43/0",
            // The prefix does not hide another endpoint's sources in a watched namespace.
            "advertise dynamo/prefill/generate 1bbe13eb67504f worker dc71242afcad0e39/0",
            "channel+ dynamo/backend/generate kv-events 1a0878c30c67ae",
            "channel+ dynamo/backend/generate kv_metrics 1a0878c30c67ae",
            "channel+ dynamo/prefill/generate kv-events 1bbe13eb67504f",
            "channel+ dynamo/prefill/generate kv_metrics 1bbe13eb67504f",
        ]
    );
    // Out-of-scope records are not even decoded.
    assert_eq!(differ.counters().accepted(), 8);
}

#[test]
fn file_paths_are_read_in_the_file_backend_spelling() {
    let mut differ =
        RecordDiffer::new(DiscoveryScope::watch_all(Vec::new()).unwrap(), KeyForm::FilePath);
    let outputs = differ.apply_listing(
        vec![
            ListingEntry::bytes(
                "v1/instances/dynamo%2Fbackend%2Fgenerate%2Fc068c01457d23c43",
                instance_json(&backend(), WORKER_A),
            ),
            ListingEntry::bytes(
                "v1/event_sources/namespace%2Fdynamo%2Fcomponent%2Fbackend%2Fendpoint\
                 %2Fgenerate%2Ftopic%2Fkv%2Devents%2F1a0878c30c67ae",
                source_json(&backend(), WORKER_A, PUBLISHER_A, 0),
            ),
        ],
        ListingMode::Poll,
    );
    assert_eq!(
        summary(&outputs),
        vec![
            "listed[]",
            "instances dynamo/backend/generate Some([\"c068c01457d23c43\"])",
            "advertise dynamo/backend/generate 1a0878c30c67ae worker c068c01457d23c43/0",
        ]
    );
    // A logical key is not a file path.
    differ.apply_listing(
        vec![ListingEntry::bytes(
            instance_key(&backend(), WORKER_A),
            instance_json(&backend(), WORKER_A),
        )],
        ListingMode::Poll,
    );
    assert_eq!(differ.counters().rejected(InputErrorKind::MalformedKey), 1);
}

#[test]
fn channel_removal_names_the_channel_key() {
    let mut differ = differ();
    differ.apply_listing(worker(&backend(), WORKER_A, PUBLISHER_A), ListingMode::Relist);
    let removed = differ.apply_delete(&channel_key(&backend(), "kv_metrics", PUBLISHER_A));
    assert_eq!(
        removed,
        vec![DiscoveryOutput::Channel(ChannelChange::Remove(EventRecordKey {
            scope: backend(),
            topic: "kv_metrics".into(),
            publisher_id: PUBLISHER_A,
        }))]
    );
}

#[test]
fn the_same_inputs_give_the_same_outputs() {
    let run = || {
        let mut differ = differ();
        let mut entries = worker(&prefill(), WORKER_B, PUBLISHER_B);
        entries.extend(worker(&backend(), WORKER_A, PUBLISHER_A));
        let mut outputs = differ.apply_listing(entries, ListingMode::Poll);
        outputs.extend(differ.apply_listing(Vec::new(), ListingMode::Poll));
        outputs
    };
    assert_eq!(run(), run());
}

#[test]
fn a_namespace_limit_narrows_and_widens_the_scope_with_the_next_listing() {
    let mut differ = differ();
    let staging = EndpointPath::new("staging", "backend", "generate").unwrap();
    let mut entries = worker(&backend(), WORKER_A, PUBLISHER_A);
    entries.extend(worker(&staging, WORKER_B, PUBLISHER_B));
    differ.set_namespace_limit(Some(BTreeSet::from(["staging".to_owned()])));
    let outputs = differ.apply_listing(entries.clone(), ListingMode::Poll);
    assert_eq!(summary(&outputs)[0], "listed[dc71242afcad0e39]");
    assert!(summary(&outputs).iter().all(|line| !line.contains("dynamo/")), "{outputs:?}");

    // Widening brings the other namespace in with the next listing.
    differ.set_namespace_limit(Some(BTreeSet::from(["dynamo".to_owned(), "staging".to_owned()])));
    let widened = summary(&differ.apply_listing(entries.clone(), ListingMode::Poll));
    assert!(
        widened
            .contains(&"instances dynamo/backend/generate Some([\"c068c01457d23c43\"])".to_owned()),
        "{widened:?}"
    );
    assert!(widened.iter().all(|line| !line.contains("staging/")), "{widened:?}");

    // An empty limit withdraws everything held: cards, instance sets, sources and channels.
    differ.set_namespace_limit(Some(BTreeSet::new()));
    let emptied = summary(&differ.apply_listing(entries, ListingMode::Poll));
    for expected in [
        "instances dynamo/backend/generate Some([])",
        "instances staging/backend/generate Some([])",
    ] {
        assert!(emptied.contains(&expected.to_owned()), "{emptied:?}");
    }
    assert!(emptied.iter().any(|line| line.starts_with("withdraw")), "{emptied:?}");
    assert!(emptied.iter().any(|line| line.starts_with("channel-")), "{emptied:?}");
    assert_eq!(differ.key_count(), 0);
}

// ---- reconciling relists, unchanged entries and soft errors ----------------------------------

#[test]
fn a_reconciling_relist_emits_nothing_for_the_same_state_and_exactly_the_drift() {
    let mut differ = differ();
    let mut listing = worker(&backend(), WORKER_A, PUBLISHER_A);
    listing.extend(worker(&prefill(), WORKER_B, PUBLISHER_B));
    differ.apply_listing(listing.clone(), ListingMode::Relist);
    assert!(differ.apply_listing(listing.clone(), ListingMode::Poll).is_empty());
    // Drift: one card's contents changed, one instance vanished.
    let mut drifted: Vec<ListingEntry> = listing
        .into_iter()
        .filter(|entry| entry.key != instance_key(&prefill(), WORKER_B))
        .collect();
    for entry in &mut drifted {
        if entry.key == card_key(&backend(), WORKER_A, None) {
            entry.value = EntryValue::Bytes(card_json(&backend(), WORKER_A, None, 999, ""));
        }
    }
    assert_eq!(
        summary(&differ.apply_listing(drifted.clone(), ListingMode::Poll)),
        vec![
            "upsert dynamo/backend/generate c068c01457d23c43 None",
            "instances dynamo/prefill/generate Some([])",
        ]
    );
    assert!(differ.apply_listing(drifted, ListingMode::Poll).is_empty());
}

#[test]
fn an_unchanged_entry_keeps_what_its_key_holds_without_counting_again() {
    let mut differ = differ();
    let mut listing = worker(&backend(), WORKER_A, PUBLISHER_A);
    listing.push(ListingEntry::bytes("v1/instances/not-a-key", "{}"));
    listing.push(ListingEntry::bytes(card_key(&backend(), WORKER_B, None), "{torn"));
    differ.apply_listing(listing.clone(), ListingMode::Poll);
    let counted = differ.counters().clone();
    assert_eq!(counted.rejected_total(), 2);
    let unchanged: Vec<ListingEntry> = listing
        .iter()
        .map(|entry| ListingEntry { key: entry.key.clone(), value: EntryValue::Unchanged })
        .collect();
    for _ in 0..2 {
        assert!(differ.apply_listing(unchanged.clone(), ListingMode::Poll).is_empty());
    }
    assert_eq!(differ.counters(), &counted);
    assert_eq!(differ.key_count(), listing.len() - 1);
    // An unchanged entry for a key the differ never held brings nothing.
    let mut fresh =
        RecordDiffer::new(DiscoveryScope::watch_all(Vec::new()).unwrap(), KeyForm::Logical);
    let outputs = fresh.apply_listing(unchanged, ListingMode::Poll);
    assert_eq!(summary(&outputs), vec!["listed[]"]);
    assert_eq!(fresh.key_count(), 0);
}

#[test]
fn soft_errors_follow_the_card_set_and_clear_when_the_base_card_arrives() {
    use kvrelay_core::discovery::SoftErrorKind;
    let mut differ = differ();
    let mut listing = worker(&backend(), WORKER_A, PUBLISHER_A);
    listing.push(ListingEntry::bytes(
        card_key(&backend(), WORKER_B, Some("ad")),
        card_json(&backend(), WORKER_B, Some("ad"), 0, ""),
    ));
    differ.apply_listing(listing.clone(), ListingMode::Relist);
    let report = differ.soft_errors().clone();
    assert_eq!(report.current_total, 1);
    assert_eq!(report.listed[0].kind, SoftErrorKind::OrphanAdapter);
    assert_eq!(report.listed[0].key, "dynamo/backend/generate/dc71242afcad0e39/ad");
    assert_eq!(report.appeared.get(&SoftErrorKind::OrphanAdapter), Some(&1));
    // The same listing again: still one error, not counted again.
    differ.apply_listing(listing, ListingMode::Poll);
    assert_eq!(differ.soft_errors(), &report);
    // Its base card arrives: the error clears; the counter keeps the appearance.
    differ.apply_put(
        &card_key(&backend(), WORKER_B, None),
        card_json(&backend(), WORKER_B, None, 16384, ""),
    );
    let cleared = differ.soft_errors();
    assert_eq!(cleared.current_total, 0);
    assert!(cleared.listed.is_empty());
    assert_eq!(cleared.appeared.get(&SoftErrorKind::OrphanAdapter), Some(&1));
}

#[test]
fn second_spellings_and_unreadable_keys_are_soft_errors_until_a_listing_clears_them() {
    use kvrelay_core::discovery::SoftErrorKind;
    let mut files =
        RecordDiffer::new(DiscoveryScope::watch_all(Vec::new()).unwrap(), KeyForm::FilePath);
    let spelled = "v1/instances/dynamo%2Fbackend%2Fgenerate%2Fc068c01457d23c43";
    let respelled = "v1/instances/%64ynamo%2Fbackend%2Fgenerate%2Fc068c01457d23c43";
    let instance = instance_json(&backend(), WORKER_A);
    files.apply_listing(
        vec![
            ListingEntry::bytes(spelled, instance.clone()),
            ListingEntry::bytes(respelled, instance.clone()),
        ],
        ListingMode::Poll,
    );
    let report = files.soft_errors();
    assert_eq!(report.current.get(&SoftErrorKind::DuplicateKey), Some(&1));
    // The key order decides which spelling is read: `%64...` sorts first.
    assert_eq!(report.listed[0].key, spelled);
    files.apply_listing(vec![ListingEntry::bytes(spelled, instance)], ListingMode::Poll);
    assert_eq!(files.soft_errors().current_total, 0);

    let mut etcd = differ();
    etcd.apply_listing_with_unreadable(
        worker(&backend(), WORKER_A, PUBLISHER_A),
        vec!["v1/mdc/dynamo/backend/generate/\u{fffd}".into()],
        ListingMode::Relist,
    );
    assert_eq!(etcd.soft_errors().current.get(&SoftErrorKind::UnreadableKey), Some(&1));
    etcd.note_unreadable_put("v1/instances/\u{fffd}");
    assert_eq!(etcd.soft_errors().current.get(&SoftErrorKind::UnreadableKey), Some(&2));
    etcd.note_unreadable_delete("v1/instances/\u{fffd}");
    assert_eq!(etcd.soft_errors().current.get(&SoftErrorKind::UnreadableKey), Some(&1));
    etcd.apply_listing(worker(&backend(), WORKER_A, PUBLISHER_A), ListingMode::Poll);
    assert_eq!(etcd.soft_errors().current_total, 0);
    assert_eq!(etcd.soft_errors().appeared.get(&SoftErrorKind::UnreadableKey), Some(&2));
}
