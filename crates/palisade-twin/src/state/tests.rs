#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use palisade_core::codec::{decode, encode};
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use serde_json::json;

fn at(time: u64) -> Hlc {
    Hlc { time, id: [1; 16] }
}

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

/// RFC 7396 section 2, verbatim: the reference every test compares with.
fn reference_merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(target) = target else {
        unreachable!()
    };
    for (name, value) in patch {
        if value.is_null() {
            target.remove(name);
        } else {
            reference_merge_patch(target.entry(name.clone()).or_insert(Value::Null), value);
        }
    }
}

/// Reference for `field_hlcs`, built by sequential merge patch directly on the
/// patch tree (not on this crate's op decomposition): who wrote each leaf.
fn reference_fields(
    fields: &mut BTreeMap<Vec<String>, (Hlc, bool)>,
    path: &mut Vec<String>,
    patch: &Map<String, Value>,
    hlc: Hlc,
) {
    // Merge patch turns a scalar target into `{}` before recursing into it.
    if fields
        .get(path.as_slice())
        .is_some_and(|&(_, is_set)| is_set)
    {
        fields.remove(path.as_slice());
    }
    for (key, value) in patch {
        path.push(key.clone());
        let at_or_below = |fields: &mut BTreeMap<Vec<String>, (Hlc, bool)>, path: &[String]| {
            fields.retain(|k, _| !k.starts_with(path));
        };
        match value {
            Value::Null => at_or_below(fields, path),
            Value::Object(m) if m.is_empty() => {
                if fields
                    .get(path.as_slice())
                    .is_some_and(|&(_, is_set)| is_set)
                {
                    fields.remove(path.as_slice());
                }
                fields.insert(path.clone(), (hlc, false));
            }
            Value::Object(m) => reference_fields(fields, path, m, hlc),
            _ => {
                at_or_below(fields, path);
                fields.insert(path.clone(), (hlc, true));
            }
        }
        path.pop();
    }
}

type Event = (Map<String, Value>, Hlc);

fn apply_all<'a>(events: impl IntoIterator<Item = &'a Event>) -> TwinState {
    let mut state = TwinState::new();
    for (patch, hlc) in events {
        state.apply(patch, *hlc).unwrap();
    }
    state
}

/// The same facts without any pruning, to show the output does not depend
/// on when (or whether) shadowed entries are dropped.
fn unpruned<'a>(events: impl IntoIterator<Item = &'a Event>) -> TwinState {
    let mut entries: BTreeMap<Path, Entry> = BTreeMap::new();
    for (patch, hlc) in events {
        for (path, op) in patch::decompose(patch) {
            let cleared = op.clears().then_some(*hlc);
            let e = entries.entry(path).or_insert(Entry {
                hlc: *hlc,
                op: op.clone(),
                cleared,
            });
            if (*hlc, &op) > (e.hlc, &e.op) {
                e.hlc = *hlc;
                e.op = op;
            }
            e.cleared = e.cleared.max(cleared);
        }
    }
    TwinState { entries }
}

/// Every pointer in `field_hlcs` resolves, and every scalar or array in the
/// document is listed.
fn check_fields_match_document(state: &TwinState) -> Result<(), TestCaseError> {
    let doc = state.to_json();
    let fields = state.field_hlcs();
    for ptr in fields.keys() {
        prop_assert!(doc.pointer(ptr).is_some(), "{ptr} not in {doc}");
    }
    let mut leaves = Vec::new();
    collect_leaves(&doc, String::new(), &mut leaves);
    for ptr in leaves {
        prop_assert!(fields.contains_key(&ptr), "{ptr} missing from {fields:?}");
    }
    Ok(())
}

fn collect_leaves(v: &Value, ptr: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                collect_leaves(
                    v,
                    format!("{ptr}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        _ => out.push(ptr),
    }
}

// RFC 7396 Appendix A, all of it. The twin's top level is always an object,
// so the examples whose original document or patch is not an object
// (`["a","b"]`, `["c"]`, `null`, `"bar"` patches and the `[1,2]` target)
// cannot occur and are skipped. `{"e":null}` is also skipped: a twin can
// never hold a null (null in a patch deletes), so that original cannot be
// built; `null_members_cannot_be_stored` shows what happens instead.
const APPENDIX_A: &[(&str, &str, &str)] = &[
    (r#"{"a":"b"}"#, r#"{"a":"c"}"#, r#"{"a":"c"}"#),
    (r#"{"a":"b"}"#, r#"{"b":"c"}"#, r#"{"a":"b","b":"c"}"#),
    (r#"{"a":"b"}"#, r#"{"a":null}"#, r#"{}"#),
    (r#"{"a":"b","b":"c"}"#, r#"{"a":null}"#, r#"{"b":"c"}"#),
    (r#"{"a":["b"]}"#, r#"{"a":"c"}"#, r#"{"a":"c"}"#),
    (r#"{"a":"c"}"#, r#"{"a":["b"]}"#, r#"{"a":["b"]}"#),
    (
        r#"{"a":{"b":"c"}}"#,
        r#"{"a":{"b":"d","c":null}}"#,
        r#"{"a":{"b":"d"}}"#,
    ),
    (r#"{"a":[{"b":"c"}]}"#, r#"{"a":[1]}"#, r#"{"a":[1]}"#),
    (
        r#"{}"#,
        r#"{"a":{"bb":{"ccc":null}}}"#,
        r#"{"a":{"bb":{}}}"#,
    ),
];

#[test]
fn rfc7396_appendix_a() {
    for &(original, patch, result) in APPENDIX_A {
        let events = [(obj(parse(original)), at(1)), (obj(parse(patch)), at(2))];
        let want = parse(result);

        let mut reference = json!({});
        for (p, _) in &events {
            reference_merge_patch(&mut reference, &Value::Object(p.clone()));
        }
        assert_eq!(reference, want, "reference, {patch} on {original}");

        let in_order = apply_all(&events);
        assert_eq!(in_order.to_json(), want, "{patch} on {original}");
        let reversed = apply_all(events.iter().rev());
        assert_eq!(reversed, in_order, "{patch} on {original}, reversed");
    }
}

#[test]
fn null_members_cannot_be_stored() {
    let state = apply_all(&[
        (obj(json!({"e": null})), at(1)),
        (obj(json!({"a": 1})), at(2)),
    ]);
    // RFC 7396 gives {"e":null,"a":1} when the target already holds a null;
    // a twin built from patches never does.
    assert_eq!(state.to_json(), json!({"a": 1}));
}

#[test]
fn tombstone_beats_an_older_set_arriving_late() {
    let state = apply_all(&[
        (obj(json!({"a": null, "b": 2})), at(5)),
        (obj(json!({"a": 1, "b": 1})), at(3)),
    ]);
    assert_eq!(state.to_json(), json!({"b": 2}));
    assert_eq!(state.max_hlc(), Some(at(5)));
}

#[test]
fn a_set_that_lost_to_a_later_empty_object_still_wiped_below() {
    let events = [
        (obj(json!({"a": {"x": 1}})), at(1)),
        (obj(json!({"a": 5})), at(2)),
        (obj(json!({"a": {}})), at(3)),
    ];
    let orders = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    let first = apply_all(&events);
    assert_eq!(first.to_json(), json!({"a": {}}));
    for order in orders {
        let state = apply_all(order.iter().map(|&i| &events[i]));
        assert_eq!(state, first, "{order:?}");
    }
}

#[test]
fn an_empty_object_keeps_existing_members() {
    let events = [
        (obj(json!({"a": {"x": 1}})), at(1)),
        (obj(json!({"a": {}})), at(2)),
        (obj(json!({"a": {"y": 2}})), at(3)),
    ];
    let state = apply_all(&events);
    assert_eq!(state.to_json(), json!({"a": {"x": 1, "y": 2}}));
    assert_eq!(apply_all(events.iter().rev()), state);
}

#[test]
fn writes_under_a_newer_scalar_are_pruned_on_arrival() {
    let state = apply_all(&[
        (obj(json!({"a": 1})), at(2)),
        (obj(json!({"a": {"b": {"c": 1}}, "d": 4})), at(1)),
    ]);
    assert_eq!(state.to_json(), json!({"a": 1, "d": 4}));
    assert_eq!(state.entries.len(), 2);
}

#[test]
fn empty_and_tombstone_only_states() {
    let mut state = TwinState::new();
    assert!(state.is_empty());
    assert_eq!(state.max_hlc(), None);
    assert_eq!(state.to_json(), json!({}));
    state.apply(&Map::new(), at(1)).unwrap();
    assert!(state.is_empty());
    state.apply(&obj(json!({"gone": null})), at(2)).unwrap();
    assert!(!state.is_empty());
    assert_eq!(state.max_hlc(), Some(at(2)));
    assert_eq!(state.to_json(), json!({}));
    assert!(state.field_hlcs().is_empty());
}

#[test]
fn merge_with_empty_and_with_itself_changes_nothing() {
    let state = apply_all(&[
        (obj(json!({"a": {"b": 1}, "c": [1, 2]})), at(1)),
        (obj(json!({"a": {"b": null}})), at(2)),
    ]);
    let mut twice = state.clone();
    twice.merge(&state);
    assert_eq!(twice, state);
    let mut from_empty = TwinState::new();
    from_empty.merge(&state);
    assert_eq!(from_empty, state);
    let mut into = state.clone();
    into.merge(&TwinState::new());
    assert_eq!(into, state);
}

fn nested(levels: usize, leaf: Value) -> Map<String, Value> {
    let mut v = leaf;
    for _ in 1..levels {
        v = json!({ "k": v });
    }
    obj(v)
}

#[test]
fn patches_deeper_than_the_limit_are_refused_and_change_nothing() {
    let mut state = apply_all(&[(obj(json!({"keep": 1})), at(1))]);
    let before = state.clone();
    let too_deep = PatchError::TooDeep {
        max: MAX_PATCH_DEPTH,
    };

    let deep = nested(40, json!(1));
    assert_eq!(TwinState::validate(&deep), Err(too_deep.clone()));
    assert_eq!(state.apply(&deep, at(2)), Err(too_deep.clone()));
    assert_eq!(state, before);

    // Exactly at the limit is fine; one more level is not.
    let deepest_object = nested(MAX_PATCH_DEPTH, json!({}));
    let one_more = nested(MAX_PATCH_DEPTH + 1, json!({}));
    assert_eq!(TwinState::validate(&deepest_object), Ok(()));
    assert_eq!(TwinState::validate(&one_more), Err(too_deep.clone()));

    // Arrays count as levels too: they are stored as text and must parse back.
    let mut arrays = json!(1);
    for _ in 0..MAX_PATCH_DEPTH {
        arrays = json!([arrays]);
    }
    let in_arrays = obj(json!({ "a": arrays }));
    assert_eq!(state.apply(&in_arrays, at(3)), Err(too_deep));
    assert_eq!(state, before);

    // Far deeper input is refused without walking all of it.
    assert!(TwinState::validate(&nested(1_000, json!(1))).is_err());

    state.apply(&deepest_object, at(4)).unwrap();
    assert_eq!(
        state.to_json().pointer(&"/k".repeat(MAX_PATCH_DEPTH - 1)),
        Some(&json!({}))
    );
}

#[test]
fn field_hlcs_are_escaped_pointers_to_visible_leaves() {
    let state = apply_all(&[
        (
            obj(json!({"a/b": 1, "m~n": {"x/~y": [2]}, "gone": null, "s": "scalar"})),
            at(1),
        ),
        (obj(json!({"o": {}})), at(2)),
        (obj(json!({"o": {"p": true}, "s": {"t": 3}})), at(3)),
    ]);
    let want: BTreeMap<String, Hlc> = [
        ("/a~1b", at(1)),
        ("/m~0n/x~1~0y", at(1)),
        ("/o", at(2)),
        ("/o/p", at(3)),
        // "/s" was a scalar written at 1, replaced by an object at 3.
        ("/s/t", at(3)),
    ]
    .into_iter()
    .map(|(p, h)| (p.to_owned(), h))
    .collect();
    assert_eq!(state.field_hlcs(), want);
    let doc = state.to_json();
    assert_eq!(doc.pointer("/m~0n/x~1~0y"), Some(&json!([2])));
    assert_eq!(doc.pointer("/a~1b"), Some(&json!(1)));
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![Just("a"), Just("b"), Just("c")].prop_map(String::from)
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0i64..3).prop_map(Value::from),
        prop_oneof![Just("x"), Just("y")].prop_map(Value::from),
        Just(Value::Null),
        vec(0i64..2, 0..3).prop_map(Value::from),
    ]
}

/// An object whose members nest at most `depth` more objects: `object(2)`
/// is a patch at most 3 levels deep. Empty objects come out often.
fn object(depth: u32) -> BoxedStrategy<Map<String, Value>> {
    let member = if depth == 0 {
        leaf().boxed()
    } else {
        prop_oneof![3 => leaf(), 2 => object(depth - 1).prop_map(Value::Object)].boxed()
    };
    btree_map(key(), member, 0..3)
        .prop_map(|m| m.into_iter().collect())
        .boxed()
}

/// Patches, a permutation of their indices and a split into two replicas.
fn scenario(
    hlcs: impl Strategy<Value = Vec<Hlc>> + Clone + 'static,
) -> impl Strategy<Value = (Vec<Event>, Vec<usize>, Vec<bool>)> {
    vec(object(2), 1..8).prop_flat_map(move |patches| {
        let n = patches.len();
        (
            hlcs.clone()
                .prop_map(move |hlcs| patches.iter().cloned().zip(hlcs).collect::<Vec<_>>()),
            Just((0..n).collect::<Vec<_>>()).prop_shuffle(),
            vec(any::<bool>(), n),
        )
    })
}

/// Distinct increasing HLCs, with gaps and two clock ids.
fn distinct_hlcs() -> impl Strategy<Value = Vec<Hlc>> + Clone {
    vec((1u64..4, any::<bool>()), 8).prop_map(|steps| {
        let mut time = 0;
        steps
            .into_iter()
            .map(|(gap, other_clock)| {
                time += gap;
                Hlc {
                    time,
                    id: [if other_clock { 2 } else { 1 }; 16],
                }
            })
            .collect()
    })
}

/// HLCs that often collide, where only determinism can be asked for.
fn colliding_hlcs() -> impl Strategy<Value = Vec<Hlc>> + Clone {
    vec((0u64..3, 1u8..3), 8).prop_map(|v| {
        v.into_iter()
            .map(|(time, id)| Hlc { time, id: [id; 16] })
            .collect()
    })
}

fn check_convergence(
    events: &[Event],
    perm: &[usize],
    split: &[bool],
) -> Result<TwinState, TestCaseError> {
    let in_order = apply_all(events);
    let json = in_order.to_json().to_string();

    let shuffled = apply_all(perm.iter().map(|&i| &events[i]));
    prop_assert_eq!(&shuffled, &in_order);
    prop_assert_eq!(shuffled.to_json().to_string(), json.clone());

    let (mut left, mut right) = (TwinState::new(), TwinState::new());
    for &i in perm {
        let (patch, hlc) = &events[i];
        let side = if split[i] { &mut left } else { &mut right };
        side.apply(patch, *hlc).unwrap();
    }
    let mut left_right = left.clone();
    left_right.merge(&right);
    let mut right_left = right.clone();
    right_left.merge(&left);
    prop_assert_eq!(&left_right, &in_order);
    prop_assert_eq!(&right_left, &in_order);
    left_right.merge(&right);
    prop_assert_eq!(&left_right, &in_order);

    let bytes = encode(&in_order);
    prop_assert_eq!(&encode(&shuffled), &bytes);
    prop_assert_eq!(decode::<TwinState>(&bytes).unwrap(), in_order.clone());

    let raw = unpruned(events);
    prop_assert_eq!(raw.to_json().to_string(), json);
    prop_assert_eq!(raw.field_hlcs(), in_order.field_hlcs());
    prop_assert_eq!(raw.max_hlc(), in_order.max_hlc());
    let mut canonical = TwinState::new();
    canonical.merge(&raw);
    prop_assert_eq!(&canonical, &in_order);

    check_fields_match_document(&in_order)?;
    Ok(in_order)
}

proptest! {
    #[test]
    fn in_hlc_order_it_is_merge_patch_and_any_order_converges(
        (events, perm, split) in scenario(distinct_hlcs())
    ) {
        let state = check_convergence(&events, &perm, &split)?;

        let mut reference = json!({});
        let mut fields = BTreeMap::new();
        for (patch, hlc) in &events {
            reference_merge_patch(&mut reference, &Value::Object(patch.clone()));
            reference_fields(&mut fields, &mut Vec::new(), patch, *hlc);
        }
        prop_assert_eq!(state.to_json(), reference);
        let fields: BTreeMap<String, Hlc> =
            fields.into_iter().map(|(path, (hlc, _))| (pointer(&path), hlc)).collect();
        prop_assert_eq!(state.field_hlcs(), fields);
    }

    #[test]
    fn equal_hlcs_still_converge(
        (events, perm, split) in scenario(colliding_hlcs())
    ) {
        check_convergence(&events, &perm, &split)?;
    }
}
