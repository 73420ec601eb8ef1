//! The JSON Schemas of the ABI's JSON values (`connector-api/schema/`, which `kvconnect.h`
//! points C plugin authors at): the checked-in files are the ones the Rust types make (a
//! changed type rewrites them and fails, so the change is seen), and real values — every
//! built-in connector's and the example plugin's info and capabilities, contexts for the
//! repository's real model configs, the errors real calls return — validate against the
//! files as checked in.

use kvconnect_api::ffi::{json_schemas, SCHEMA_DIR};
use kvconnect_api::{ConnectorError, ConnectorFactory, Dtype, KvLayout, KvRole, KvTransferConfig, ModelSpec};
use kvconnect_engine::local_effective_layout;
use kvconnect_registry::loader::{load_plugin, LoaderOptions};
use kvconnect_registry::Registry;
use kvconnect_tests::plugin_fixtures::example_plugin;
use kvconnect_tests::workspace_root;
use serde_json::{json, Value};
use std::path::Path;

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).expect("a schema is JSON") + "\n"
}

#[test]
fn the_checked_in_schemas_are_the_ones_the_types_make() {
    let dir = workspace_root().join(SCHEMA_DIR);
    std::fs::create_dir_all(&dir).expect("create the schema directory");
    let mut changed = Vec::new();
    for (file, schema) in json_schemas() {
        let path = dir.join(file);
        let want = pretty(&schema);
        if std::fs::read_to_string(&path).ok().as_deref() != Some(want.as_str()) {
            std::fs::write(&path, &want).expect("write a schema file");
            changed.push(file);
        }
    }
    assert!(
        changed.is_empty(),
        "the ABI's JSON types changed; rewrote {changed:?} in {SCHEMA_DIR}: review and commit them"
    );
}

/// The checked-in schemas, compiled.
struct Checked {
    schemas: boon::Schemas,
    index: Vec<(&'static str, boon::SchemaIndex)>,
}

impl Checked {
    fn load() -> Checked {
        let dir = workspace_root().join(SCHEMA_DIR);
        let mut schemas = boon::Schemas::new();
        let mut compiler = boon::Compiler::new();
        let mut index = Vec::new();
        for (file, _) in json_schemas() {
            let text = std::fs::read_to_string(dir.join(file))
                .unwrap_or_else(|e| panic!("read {SCHEMA_DIR}/{file}: {e}"));
            let value: Value = serde_json::from_str(&text).expect("a schema file is JSON");
            let url = format!("file:///kvconnect/{file}");
            compiler.add_resource(&url, value).expect("add a schema");
            let i = compiler.compile(&url, &mut schemas).unwrap_or_else(|e| panic!("{file} compiles: {e}"));
            index.push((file, i));
        }
        Checked { schemas, index }
    }

    fn check(&self, file: &str, what: &str, v: &Value) -> Result<(), String> {
        let (_, i) = self.index.iter().find(|(f, _)| *f == file).expect("a schema of that name");
        self.schemas.validate(v, *i).map_err(|e| format!("{what} does not match {file}: {e:#}\n{v}"))
    }

    fn assert_valid(&self, file: &str, what: &str, v: impl kvconnect_api::serde::Serialize) {
        let v = serde_json::to_value(v).expect("serialise a value");
        if let Err(e) = self.check(file, what, &v) {
            panic!("{e}");
        }
    }
}

fn models() -> Vec<(String, ModelSpec)> {
    let dir = workspace_root().join("fixtures/models");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("read fixtures/models") {
        let path = entry.expect("a directory entry").path().join("config.json");
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        if let Ok(model) = ModelSpec::from_hf_config_json(&text) {
            out.push((path.display().to_string(), model));
        }
    }
    assert!(out.len() >= 5, "the repository's model configs read: {}", out.len());
    out
}

/// A factory's info and capabilities for each model, and the errors it answers with.
fn check_factory(c: &Checked, what: &str, f: &dyn ConnectorFactory, errors: &mut Vec<ConnectorError>) {
    c.assert_valid("connector_info.schema.json", &format!("{what} info"), f.info());
    let mut config = KvTransferConfig::named(&f.info().name);
    // A composite answers for its children.
    config.kv_connector_extra_config.insert(
        "connectors".into(),
        json!([{"kv_connector": "LMCacheConnectorV1"}, {"kv_connector": "NixlConnector"}]),
    );
    let mut answered = 0;
    for model in std::iter::once(None).chain(models().into_iter().map(|(_, m)| Some(m))) {
        match f.capabilities(&config, model.as_ref()) {
            Ok(caps) => {
                c.assert_valid("capabilities.schema.json", &format!("{what} capabilities"), caps);
                answered += 1;
            }
            Err(e) => errors.push(e),
        }
    }
    assert!(answered > 0, "{what} answered no capabilities query");
}

#[test]
fn real_values_match_the_checked_in_schemas() {
    let c = Checked::load();
    let mut errors = Vec::new();

    let registry = Registry::builtins_only();
    let builtins: Vec<_> = registry.entries().into_iter().collect();
    assert!(builtins.len() >= 3, "the built-in connectors: {}", builtins.len());
    for e in &builtins {
        check_factory(&c, &format!("built-in {}", e.name), e.factory.as_ref(), &mut errors);
    }

    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let plugin =
        load_plugin(&example_plugin(tmp), &LoaderOptions::default()).expect("load the example plugin");
    check_factory(&c, "the example plugin", plugin.factory.as_ref(), &mut errors);

    for (path, model) in models() {
        let hma = model.layers.iter().any(|l| *l != model.layers[0]) || model.state.is_some();
        let ctx = kvconnect_api::ConnectorContext {
            config: KvTransferConfig::named("example"),
            effective: local_effective_layout(&model, KvLayout::HND, hma, 16, Dtype::Bf16),
            model,
            role: KvRole::Both,
            engine_id: "engine-0".into(),
            tp_rank: 0,
            tp_size: 1,
        };
        c.assert_valid("connector_context.schema.json", &format!("the context for {path}"), &ctx);
        // The example plugin without its `dir` setting refuses the context: a real error.
        if let Err(e) = plugin.factory.create_worker(&ctx) {
            errors.push(e);
        }
    }

    assert!(!errors.is_empty(), "no call returned an error to check");
    for e in &errors {
        c.assert_valid("connector_error.schema.json", &format!("the error `{e}`"), e);
    }
}

#[test]
fn values_the_host_would_refuse_do_not_match() {
    let c = Checked::load();
    // A misspelt field (the host refuses unknown capability fields).
    let caps = json!({"hma": false, "memory_kinds": ["host"], "transfer_mode": "none", "roles": ["kv_both"],
        "layerwise": true, "hmaa": true});
    assert!(c.check("capabilities.schema.json", "a misspelt field", &caps).is_err());
    // A layout that is not one.
    let mut caps = caps.as_object().expect("an object").clone();
    caps.remove("hmaa");
    caps.insert("layout".into(), json!({"preferred": ["NHX"]}));
    assert!(c.check("capabilities.schema.json", "a bad layout", &Value::Object(caps.clone())).is_err());
    caps.insert("layout".into(), json!({"preferred": ["NHD"]}));
    assert!(c.check("capabilities.schema.json", "a good layout", &Value::Object(caps)).is_ok());
    // An info without its description; an error of no known kind.
    assert!(c
        .check("connector_info.schema.json", "no description", &json!({"name": "x", "version": "1"}))
        .is_err());
    assert!(c
        .check("connector_error.schema.json", "an unknown kind", &json!({"Oops": {"message": "x"}}))
        .is_err());
}
