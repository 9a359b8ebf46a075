//! Unit tests of `wire`: adverts round-trip through protobuf, and every kind of bad remote
//! input is a typed error rather than a panic or a silently wrong advert.

use super::*;

fn advert(id: &PeerId, other: &PeerId) -> NodeAdvert {
    let me = id.to_string();
    let you = other.to_string();
    let footprint = ModelFootprint { model: "qwen".into(), layers: 28, bytes_per_layer: 1 << 20, kv_bytes_per_layer: 1 << 23, dense_half: true, quantized: true, embedding_bytes: 5, head_bytes: 6, ..Default::default() };
    let placement = Placement {
        strategy: Strategy::Pipeline,
        stages: vec![Stage { node: me.clone(), start: 0, end: 10, group: vec![] }, Stage { node: you.clone(), start: 10, end: 28, group: vec![] }],
    };
    let placements = BTreeMap::from([("qwen".to_string(), Ok(placement)), ("huge".to_string(), Err("does not fit".to_string()))]);
    NodeAdvert {
        id: me.clone(),
        name: "box".into(),
        priority: -3,
        memory_total: 64 << 30,
        memory_offered: 32 << 30,
        mem_bandwidth: 38e9,
        flops: 1.2e11,
        backend: "cuda:0".into(),
        gpu: Some(crate::cluster::GpuAdvert { name: "NVIDIA H100 80GB HBM3".into(), memory_total: 80 << 30 }),
        decode_bandwidth: 21e9,
        addresses: vec!["/ip4/10.0.0.1/tcp/52416".into()],
        models: vec!["qwen".into()],
        wants: vec![footprint],
        plan: Some(Plan { epoch: Epoch { round: 7, leader: me.clone() }, members: vec![me, you], placements }),
    }
}

fn stages(p: &mut v1::Advert) -> &mut Vec<v1::Stage> {
    let placements = &mut p.plan.as_mut().unwrap().placements;
    let qwen = placements.iter_mut().find(|m| m.model == "qwen").unwrap();
    match qwen.outcome.as_mut().unwrap() {
        v1::model_placement::Outcome::Placement(placement) => &mut placement.stages,
        v1::model_placement::Outcome::Error(_) => unreachable!("the fixture places qwen"),
    }
}

fn proto_of(a: &NodeAdvert) -> v1::Advert {
    advert_to_proto(a)
}

#[test]
fn an_advert_round_trips() {
    let (me, you) = (PeerId::random(), PeerId::random());
    let a = advert(&me, &you);
    assert_eq!(decode_advert(&encode_advert(&a), &me).unwrap(), a);
    let bare = NodeAdvert { plan: None, wants: vec![], ..a };
    assert_eq!(decode_advert(&encode_advert(&bare), &me).unwrap(), bare);
}

#[test]
fn listen_addresses_travel_with_an_advert_and_bad_ones_are_refused() {
    let (me, you) = (PeerId::random(), PeerId::random());
    let a = advert(&me, &you);
    let addrs: Vec<Multiaddr> = vec!["/ip4/10.0.0.1/tcp/52416".parse().unwrap(), "/ip4/127.0.0.1/udp/52416/quic-v1".parse().unwrap()];
    assert_eq!(decode_advert_from(&encode_advert_from(&a, &addrs), &me).unwrap(), (a.clone(), addrs.clone()));
    let with_id = |peer: &PeerId| {
        let mut p = proto_of(&a);
        p.listen_addrs = vec![format!("/ip4/10.0.0.1/tcp/52416/p2p/{peer}")];
        p.encode_to_vec()
    };
    assert_eq!(decode_advert_from(&with_id(&me), &me).unwrap().1, addrs[..1], "our own /p2p suffix is dropped");
    assert!(matches!(decode_advert_from(&with_id(&you), &me), Err(WireError::NotSigner { .. })), "no dialling someone else's id");
    let mut p = proto_of(&a);
    p.listen_addrs = vec!["not an address".into()];
    assert!(matches!(decode_advert_from(&p.encode_to_vec(), &me), Err(WireError::Decode(_))));
    p.listen_addrs = vec!["/ip4/10.0.0.1/tcp/1".into(); MAX_ADDRESSES + 1];
    assert!(matches!(decode_advert_from(&p.encode_to_vec(), &me), Err(WireError::TooMany { .. })));
}

#[test]
fn an_advert_not_signed_by_its_node_is_refused() {
    let (me, you) = (PeerId::random(), PeerId::random());
    let a = advert(&me, &you);
    assert!(matches!(decode_advert(&encode_advert(&a), &you), Err(WireError::NotSigner { .. })));
}

#[test]
fn garbage_and_other_versions_are_refused() {
    let me = PeerId::random();
    assert!(matches!(decode_advert(&[0xff, 0xff, 0xff], &me), Err(WireError::Decode(_))));
    // A string field holding invalid UTF-8 (field 2, id, length 2) fails to decode.
    assert!(matches!(decode_advert(&[0x12, 0x02, 0xc3, 0x28], &me), Err(WireError::Decode(_))));
    let mut p = proto_of(&advert(&me, &PeerId::random()));
    p.version = 2;
    assert_eq!(advert_from_proto(p, &me), Err(WireError::Version { got: 2 }));
}

#[test]
fn oversized_vectors_and_strings_are_refused() {
    let (me, you) = (PeerId::random(), PeerId::random());
    let base = proto_of(&advert(&me, &you));
    let mut p = base.clone();
    p.addresses = vec!["a".into(); MAX_ADDRESSES + 1];
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::TooMany { .. })));
    let mut p = base.clone();
    p.name = "n".repeat(MAX_STRING_BYTES + 1);
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::TooLong { .. })));
    let mut p = base.clone();
    p.wants = vec![p.wants[0].clone(); MAX_MODELS + 1];
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::TooMany { .. })));
    let mut p = base;
    p.plan.as_mut().unwrap().members = vec![me.to_string(); MAX_MEMBERS + 1];
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::TooMany { .. })));
}

#[test]
fn absurd_plans_and_footprints_are_refused() {
    let (me, you) = (PeerId::random(), PeerId::random());
    let base = proto_of(&advert(&me, &you));
    for (start, end) in [(10, 10), (11, 28), (10, 5), (10, MAX_LAYERS + 1)] {
        let mut p = base.clone();
        stages(&mut p)[1].layers = Some(v1::LayerRange { start, end });
        assert!(matches!(advert_from_proto(p, &me), Err(WireError::BadLayers { .. })), "[{start}, {end})");
    }
    let mut p = base.clone();
    stages(&mut p)[1].node = PeerId::random().to_string();
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::BadId { .. })), "a stage on a non-member");
    let mut p = base.clone();
    stages(&mut p)[1].node = "not a peer".into();
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::BadId { .. })));
    let mut p = base.clone();
    p.plan.as_mut().unwrap().epoch = None;
    assert_eq!(advert_from_proto(p, &me), Err(WireError::Missing("plan.epoch")));
    let mut p = base.clone();
    p.plan.as_mut().unwrap().members.push(me.to_string());
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::Duplicate { .. })));
    let mut p = base.clone();
    p.wants[0].bytes_per_layer = u64::MAX;
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::OutOfRange { .. })), "total_bytes would overflow");
    let mut p = base.clone();
    p.wants[0].kv_bytes_per_layer = u64::MAX / 28;
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::OutOfRange { .. })), "the KV cache counts towards total_bytes too");
    let mut p = base.clone();
    p.wants[0].layers = MAX_LAYERS + 1;
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::BadLayers { .. })));
    let mut p = base;
    p.flops = f64::NAN;
    assert!(matches!(advert_from_proto(p, &me), Err(WireError::OutOfRange { .. })));
}
