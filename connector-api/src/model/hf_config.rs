//! The Hugging Face `config.json` reader: the rules `transformers` and vLLM use to turn a
//! config into a per-layer schedule (Mistral's global `sliding_window`, Qwen2's
//! `max_window_layers`, Gemma's `sliding_window_pattern`, `layer_types`, Nemotron-H's
//! `hybrid_override_pattern`, Qwen3-Next's `full_attention_interval`, DeepSeek's MLA). A
//! config whose fields disagree is refused rather than guessed at.

use serde_json::{Map, Value};

use super::{AttentionKind, Dtype, LayerState, ModelError, ModelSpec, StateKind, MAX_LAYERS};

impl ModelSpec {
    /// Reads a Hugging Face `config.json` (its text; no file is opened).
    ///
    /// A multimodal config with a nested `text_config` is read through that; field names in
    /// errors then carry the `text_config.` prefix.
    pub fn from_hf_config_json(json: &str) -> Result<ModelSpec, ModelError> {
        let root: Value = serde_json::from_str(json).map_err(|e| ModelError::Json(e.to_string()))?;
        let Value::Object(root) = root else {
            return Err(ModelError::Json(format!(
                "the top level is {}, expected an object like {{\"num_hidden_layers\": 32, ...}}",
                describe(&root)
            )));
        };
        let root = Fields { obj: &root, prefix: "" };
        let text = match root.get("text_config") {
            None => root,
            Some(Value::Object(obj)) => Fields { obj, prefix: "text_config." },
            Some(other) => {
                return Err(root.invalid("text_config", format!("must be an object, got {}", describe(other))))
            }
        };
        parse(root, text)
    }
}

/// What one layer is, before windows and MLA dims are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Full,
    Sliding,
    Linear,
    FeedForward,
}

impl Slot {
    fn name(self) -> &'static str {
        match self {
            Slot::Full => "full attention",
            Slot::Sliding => "sliding-window attention",
            Slot::Linear => "linear attention / state space",
            Slot::FeedForward => "a block without attention",
        }
    }
}

/// A per-layer schedule and the field it came from.
struct Schedule {
    field: String,
    slots: Vec<Slot>,
}

/// One JSON object of the config, with the prefix its fields carry in messages.
#[derive(Clone, Copy)]
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'static str,
}

impl<'a> Fields<'a> {
    fn name(&self, field: &str) -> String {
        format!("{}{field}", self.prefix)
    }

    /// The field's value; `null` counts as absent, as `transformers` treats it.
    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn invalid(&self, field: &str, reason: String) -> ModelError {
        ModelError::Invalid { field: self.name(field), reason }
    }

    fn missing(&self, field: &str, hint: &str) -> ModelError {
        ModelError::Missing { field: self.name(field), hint: hint.to_string() }
    }

    /// An integer field that must be at least 1, when present.
    fn positive(&self, field: &str) -> Result<Option<u32>, ModelError> {
        self.integer(field, 1)
    }

    /// An integer field that may be 0, when present.
    fn count(&self, field: &str) -> Result<Option<u32>, ModelError> {
        self.integer(field, 0)
    }

    fn integer(&self, field: &str, min: u64) -> Result<Option<u32>, ModelError> {
        let Some(value) = self.get(field) else { return Ok(None) };
        let kind = if min == 0 { "a non-negative integer" } else { "a positive integer" };
        match value.as_u64() {
            Some(n) if n < min => Err(self.invalid(field, format!("must be {kind}, got {n}"))),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| self.invalid(field, format!("{n} is too large (at most {})", u32::MAX))),
            None => Err(self.invalid(field, format!("must be {kind}, got {value}"))),
        }
    }

    fn required(&self, field: &str, hint: &str) -> Result<u32, ModelError> {
        self.positive(field)?.ok_or_else(|| self.missing(field, hint))
    }

    fn boolean(&self, field: &str) -> Result<Option<bool>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.invalid(field, format!("must be true or false, got {other}"))),
        }
    }

    fn string(&self, field: &str) -> Result<Option<&'a str>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.invalid(field, format!("must be a string, got {other}"))),
        }
    }
}

fn describe(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn parse(root: Fields<'_>, text: Fields<'_>) -> Result<ModelSpec, ModelError> {
    let name = model_name(root, text);
    let num_layers =
        text.required("num_hidden_layers", "set it to the number of decoder layers of the model")?;
    if num_layers > MAX_LAYERS {
        return Err(text.invalid(
            "num_hidden_layers",
            format!(
                "{num_layers} layers is more than the {MAX_LAYERS} kvconnect accepts; real models \
                 have at most a few hundred, so check the value"
            ),
        ));
    }
    let num_heads = text.required("num_attention_heads", "set it to the number of query heads")?;
    let num_kv_heads = text.positive("num_key_value_heads")?.unwrap_or(num_heads);
    if num_heads % num_kv_heads != 0 {
        return Err(ModelError::Contradiction {
            a: text.name("num_attention_heads"),
            b: text.name("num_key_value_heads"),
            reason: format!(
                "{num_heads} query heads cannot be shared evenly by {num_kv_heads} KV heads; \
                 num_attention_heads must be a multiple of num_key_value_heads"
            ),
        });
    }
    let head_dim = match text.positive("head_dim")? {
        Some(d) => d,
        None => {
            let hidden = text.required(
                "hidden_size",
                "set head_dim, or hidden_size so that head_dim = hidden_size / num_attention_heads",
            )?;
            if hidden % num_heads != 0 {
                return Err(ModelError::Contradiction {
                    a: text.name("hidden_size"),
                    b: text.name("num_attention_heads"),
                    reason: format!(
                        "hidden_size {hidden} is not a multiple of {num_heads} heads, so head_dim \
                         cannot be derived; set head_dim explicitly"
                    ),
                });
            }
            hidden / num_heads
        }
    };
    let dtype = match read_dtype(text)? {
        Some(d) => Some(d),
        None if text.prefix.is_empty() => None,
        None => read_dtype(root)?,
    };
    let slots = schedule(text, num_layers)?;
    let mla = read_mla(text)?;
    let window = if slots.slots.contains(&Slot::Sliding) {
        Some(text.required(
            "sliding_window",
            &format!(
                "'{}' makes some layers sliding-window; set sliding_window to the window length in tokens",
                slots.field
            ),
        )?)
    } else {
        None
    };

    let mut layers = Vec::with_capacity(slots.slots.len());
    for (i, slot) in slots.slots.iter().enumerate() {
        layers.push(match (slot, mla, window) {
            (Slot::Full, None, _) => AttentionKind::Full,
            (Slot::Full, Some((kv_lora_rank, qk_rope_head_dim)), _) => {
                AttentionKind::Mla { kv_lora_rank, qk_rope_head_dim }
            }
            (Slot::Sliding, None, Some(window)) => AttentionKind::SlidingWindow { window },
            (Slot::Sliding, Some(_), _) => {
                return Err(ModelError::Contradiction {
                    a: text.name("kv_lora_rank"),
                    b: slots.field,
                    reason: format!(
                        "layer {i} is sliding-window, but MLA layers keep every token's latent; \
                         a sliding-window MLA layer is not supported"
                    ),
                })
            }
            // `window` is Some whenever a sliding slot exists (checked above).
            (Slot::Sliding, None, None) => {
                return Err(text.missing("sliding_window", "set it to the window length in tokens"))
            }
            (Slot::Linear, _, _) => AttentionKind::Linear,
            (Slot::FeedForward, _, _) => AttentionKind::FeedForward,
        });
    }

    let (num_kv_heads, head_dim) = match mla {
        Some((rank, rope)) => {
            let latent = rank.checked_add(rope).ok_or_else(|| {
                text.invalid(
                    "kv_lora_rank",
                    format!("kv_lora_rank {rank} + qk_rope_head_dim {rope} overflows"),
                )
            })?;
            (1, latent)
        }
        None => (num_kv_heads, head_dim),
    };

    let state = if slots.slots.contains(&Slot::Linear) { read_state(text, dtype)? } else { None };
    Ok(ModelSpec { name, num_layers, num_kv_heads, head_dim, dtype, layers, state })
}

/// `model_type (FirstArchitecture)`, or whichever of the two the config has.
fn model_name(root: Fields<'_>, text: Fields<'_>) -> String {
    let model_type = [root, text].iter().find_map(|f| f.get("model_type").and_then(Value::as_str));
    let arch = [root, text].iter().find_map(|f| {
        f.get("architectures").and_then(Value::as_array).and_then(|a| a.first()).and_then(Value::as_str)
    });
    match (model_type, arch) {
        (Some(t), Some(a)) => format!("{t} ({a})"),
        (Some(t), None) => t.to_string(),
        (None, Some(a)) => a.to_string(),
        (None, None) => "unnamed model".to_string(),
    }
}

/// `dtype` (transformers >= 4.56) or `torch_dtype`; both present must agree.
fn read_dtype(f: Fields<'_>) -> Result<Option<Dtype>, ModelError> {
    let mut found: Option<(&str, &str, Dtype)> = None;
    for field in ["dtype", "torch_dtype"] {
        let Some(s) = f.string(field)? else { continue };
        let dtype = Dtype::from_hf_name(s).ok_or_else(|| {
            f.invalid(
                field,
                format!(
                    "unknown dtype \"{s}\"; expected float32, float16, bfloat16, float8_e4m3fn (fp8) \
                     or float8_e5m2"
                ),
            )
        })?;
        match found {
            Some((other, prev_name, prev)) if prev != dtype => {
                return Err(ModelError::Contradiction {
                    a: f.name(other),
                    b: f.name(field),
                    reason: format!("{other} is \"{prev_name}\" but {field} is \"{s}\"; keep one of them"),
                })
            }
            _ => found = Some((field, s, dtype)),
        }
    }
    Ok(found.map(|(_, _, d)| d))
}

/// The state of the state-space / linear-attention layers: Mamba2 when the config has
/// `mamba_num_heads` (Nemotron-H), Gated DeltaNet when it has `linear_num_value_heads`
/// (Qwen3-Next), `None` when it has neither. A mixer named by one field needs all of its
/// dimensions; they are not guessed.
fn read_state(f: Fields<'_>, dtype: Option<Dtype>) -> Result<Option<LayerState>, ModelError> {
    let model_dtype = dtype.unwrap_or(Dtype::Bf16);
    let overflow =
        |field: &str| f.invalid(field, "the state dimensions it gives overflow 32 bits".to_owned());
    let window = |field: &str| -> Result<u32, ModelError> {
        let k = f.required(field, "set it to the causal convolution's kernel width")?;
        if k < 2 {
            return Err(
                f.invalid(field, format!("a causal conv kernel keeps k - 1 past inputs; {k} keeps none"))
            );
        }
        Ok(k - 1)
    };
    let state = |kind, past, conv_dim, ssm_shape, ssm_dtype| {
        Ok(Some(LayerState {
            kind,
            conv_shape: vec![past, conv_dim],
            conv_dtype: model_dtype,
            ssm_shape,
            ssm_dtype,
        }))
    };
    if f.get("mamba_num_heads").is_some() {
        let hint = "a Mamba2 layer's state needs it (the config has mamba_num_heads)";
        let heads = f.required("mamba_num_heads", hint)?;
        let head_dim = f.required("mamba_head_dim", hint)?;
        let state_size = f.required("ssm_state_size", hint)?;
        let groups = f.required("n_groups", hint)?;
        let past = window("conv_kernel")?;
        // vLLM's MambaMixer2: the conv runs over x (heads * head_dim) and B and C
        // (n_groups * state_size each).
        let conv_dim = heads
            .checked_mul(head_dim)
            .and_then(|x| groups.checked_mul(state_size)?.checked_mul(2)?.checked_add(x))
            .ok_or_else(|| overflow("mamba_num_heads"))?;
        let ssm_dtype = match f.string("mamba_ssm_cache_dtype")? {
            None => model_dtype,
            Some(s) if s.eq_ignore_ascii_case("auto") => model_dtype,
            Some(s) => Dtype::from_hf_name(s).ok_or_else(|| {
                f.invalid(
                    "mamba_ssm_cache_dtype",
                    format!("unknown dtype \"{s}\"; expected auto, float32, float16 or bfloat16"),
                )
            })?,
        };
        return state(StateKind::Mamba2, past, conv_dim, vec![heads, head_dim, state_size], ssm_dtype);
    }
    if f.get("linear_num_value_heads").is_some() {
        let hint = "a Gated DeltaNet layer's state needs it (the config has linear_num_value_heads)";
        let v_heads = f.required("linear_num_value_heads", hint)?;
        let k_heads = f.required("linear_num_key_heads", hint)?;
        let k_dim = f.required("linear_key_head_dim", hint)?;
        let v_dim = f.required("linear_value_head_dim", hint)?;
        let past = window("linear_conv_kernel_dim")?;
        // The conv runs over q and k (key heads each) and v (value heads).
        let conv_dim = k_heads
            .checked_mul(k_dim)
            .and_then(|qk| qk.checked_mul(2)?.checked_add(v_heads.checked_mul(v_dim)?))
            .ok_or_else(|| overflow("linear_num_value_heads"))?;
        return state(StateKind::GatedDeltaNet, past, conv_dim, vec![v_heads, k_dim, v_dim], model_dtype);
    }
    Ok(None)
}

/// DeepSeek's MLA dims, when the config has `kv_lora_rank`.
fn read_mla(f: Fields<'_>) -> Result<Option<(u32, u32)>, ModelError> {
    let Some(rank) = f.positive("kv_lora_rank")? else { return Ok(None) };
    let rope = f.required(
        "qk_rope_head_dim",
        "an MLA model (it has kv_lora_rank) stores the decoupled RoPE key beside the latent; \
         set qk_rope_head_dim to its width",
    )?;
    Ok(Some((rank, rope)))
}

/// The kind of every layer. Explicit per-layer sources must agree with each other; without
/// one, the global sliding-window rules apply.
fn schedule(f: Fields<'_>, n: u32) -> Result<Schedule, ModelError> {
    let mut explicit = Vec::new();
    if let Some(s) = layer_types(f, n)? {
        explicit.push(s);
    }
    if let Some(s) = hybrid_override_pattern(f, n)? {
        explicit.push(s);
    }
    if let Some(p) = f.positive("sliding_window_pattern")? {
        explicit.push(periodic(f.name("sliding_window_pattern"), n, p, Slot::Sliding));
    }
    if let Some(p) = f.positive("full_attention_interval")? {
        explicit.push(periodic(f.name("full_attention_interval"), n, p, Slot::Linear));
    }
    for pair in explicit.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if let Some(i) = (0..a.slots.len()).find(|&i| a.slots[i] != b.slots[i]) {
            return Err(ModelError::Contradiction {
                a: a.field.clone(),
                b: b.field.clone(),
                reason: format!(
                    "layer {i} is {} by {} but {} by {}; remove one or make them agree",
                    a.slots[i].name(),
                    a.field,
                    b.slots[i].name(),
                    b.field
                ),
            });
        }
    }

    let use_sliding = f.boolean("use_sliding_window")?;
    if let Some(s) = explicit.into_iter().next() {
        if use_sliding == Some(false) {
            if let Some(i) = s.slots.iter().position(|&slot| slot == Slot::Sliding) {
                return Err(ModelError::Contradiction {
                    a: f.name("use_sliding_window"),
                    b: s.field,
                    reason: format!("use_sliding_window is false but layer {i} is sliding-window"),
                });
            }
        }
        return Ok(s);
    }

    // No per-layer source. `use_sliding_window: false` (Qwen2/3) turns the window off
    // whatever `sliding_window` says, so its value is not checked.
    if use_sliding == Some(false) {
        return Ok(uniform(f.name("use_sliding_window"), n, Slot::Full));
    }
    if f.positive("sliding_window")?.is_none() {
        return Ok(uniform("(no sliding_window)".to_string(), n, Slot::Full));
    }
    // Gemma 2 and 3 interleave without saying so: transformers' class defaults are a
    // pattern of 2 and 6 when neither layer_types nor sliding_window_pattern is saved.
    let model_type = f.get("model_type").and_then(Value::as_str);
    let default_pattern = match model_type {
        Some("gemma2") => Some(2),
        Some("gemma3" | "gemma3_text") => Some(6),
        _ => None,
    };
    if let Some(p) = default_pattern {
        return Ok(periodic(f.name("model_type"), n, p, Slot::Sliding));
    }
    // Qwen2's rule: with use_sliding_window on, the first max_window_layers layers stay full.
    if use_sliding == Some(true) {
        if let Some(m) = f.count("max_window_layers")? {
            let slots = (0..n).map(|i| if i < m { Slot::Full } else { Slot::Sliding }).collect();
            return Ok(Schedule { field: f.name("max_window_layers"), slots });
        }
    }
    // Mistral: one window on every layer.
    Ok(uniform(f.name("sliding_window"), n, Slot::Sliding))
}

fn uniform(field: String, n: u32, slot: Slot) -> Schedule {
    Schedule { field, slots: vec![slot; n as usize] }
}

/// Layer i is full iff (i + 1) % period == 0, `other` otherwise (transformers' rule for
/// Gemma's sliding_window_pattern and Qwen3-Next's full_attention_interval).
fn periodic(field: String, n: u32, period: u32, other: Slot) -> Schedule {
    let slots = (0..n).map(|i| if (i + 1) % period == 0 { Slot::Full } else { other }).collect();
    Schedule { field, slots }
}

fn layer_types(f: Fields<'_>, n: u32) -> Result<Option<Schedule>, ModelError> {
    let field = f.name("layer_types");
    let Some(value) = f.get("layer_types") else { return Ok(None) };
    let Value::Array(entries) = value else {
        return Err(f.invalid("layer_types", format!("must be an array of strings, got {}", describe(value))));
    };
    if entries.len() != n as usize {
        return Err(ModelError::Contradiction {
            a: field,
            b: f.name("num_hidden_layers"),
            reason: format!("layer_types has {} entries but num_hidden_layers is {n}", entries.len()),
        });
    }
    let mut slots = Vec::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        slots.push(match entry.as_str() {
            Some("full_attention") => Slot::Full,
            Some("sliding_attention") => Slot::Sliding,
            Some("linear_attention" | "mamba") => Slot::Linear,
            _ => {
                return Err(f.invalid(
                    "layer_types",
                    format!(
                        "entry {i} is {entry}; expected \"full_attention\", \"sliding_attention\", \
                         \"linear_attention\" or \"mamba\""
                    ),
                ))
            }
        });
    }
    Ok(Some(Schedule { field, slots }))
}

fn hybrid_override_pattern(f: Fields<'_>, n: u32) -> Result<Option<Schedule>, ModelError> {
    let field = f.name("hybrid_override_pattern");
    let Some(pattern) = f.string("hybrid_override_pattern")? else { return Ok(None) };
    let len = pattern.chars().count();
    if len != n as usize {
        return Err(ModelError::Contradiction {
            a: field,
            b: f.name("num_hidden_layers"),
            reason: format!("hybrid_override_pattern has {len} letters but num_hidden_layers is {n}"),
        });
    }
    let mut slots = Vec::with_capacity(len);
    for (i, c) in pattern.chars().enumerate() {
        slots.push(match c {
            '*' => Slot::Full,
            'M' => Slot::Linear,
            'E' | '-' => Slot::FeedForward,
            _ => {
                return Err(f.invalid(
                    "hybrid_override_pattern",
                    format!(
                        "letter {i} is '{c}'; expected 'M' (Mamba), '*' (attention), 'E' (MoE) or '-' (MLP)"
                    ),
                ))
            }
        });
    }
    Ok(Some(Schedule { field, slots }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::LayerId;
    use proptest::prelude::*;

    const QWEN3: &str = include_str!("../../fixtures/models/Qwen--Qwen3-0.6B/config.json");
    const LLAMA: &str = include_str!("../../fixtures/models/meta-llama--Llama-3.1-8B-Instruct/config.json");
    const GEMMA3: &str = include_str!("../../fixtures/models/google--gemma-3-1b-it/config.json");
    const GPT_OSS: &str = include_str!("../../fixtures/models/openai--gpt-oss-20b/config.json");
    const DEEPSEEK: &str = include_str!("../../fixtures/models/deepseek-ai--DeepSeek-V2-Lite/config.json");
    const MISTRAL: &str = include_str!("../../fixtures/models/mistralai--Mistral-7B-v0.1/config.json");
    const QWEN3_NEXT: &str =
        include_str!("../../fixtures/models/Qwen--Qwen3-Next-80B-A3B-Thinking/config.json");
    const NEMOTRON: &str =
        include_str!("../../fixtures/models/nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16/config.json");

    fn parse(json: &str) -> ModelSpec {
        ModelSpec::from_hf_config_json(json).unwrap()
    }

    fn err(json: &str) -> ModelError {
        ModelSpec::from_hf_config_json(json).unwrap_err()
    }

    /// Indices of the layers of one kind.
    fn indices(spec: &ModelSpec, pred: impl Fn(&AttentionKind) -> bool) -> Vec<u32> {
        (0u32..).zip(&spec.layers).filter(|(_, k)| pred(k)).map(|(i, _)| i).collect()
    }

    fn is_full(k: &AttentionKind) -> bool {
        matches!(k, AttentionKind::Full)
    }

    /// A fixture with one field replaced (or removed with `Value::Null` as `remove`).
    fn edit(json: &str, edits: &[(&str, Option<Value>)]) -> String {
        let mut v: Value = serde_json::from_str(json).unwrap();
        let obj = v.as_object_mut().unwrap();
        for (k, val) in edits {
            match val {
                Some(val) => obj.insert(k.to_string(), val.clone()),
                None => obj.remove(*k),
            };
        }
        serde_json::to_string(&v).unwrap()
    }

    fn names_field(e: &ModelError, field: &str) -> bool {
        match e {
            ModelError::Missing { field: f, .. } | ModelError::Invalid { field: f, .. } => f == field,
            ModelError::Contradiction { a, b, .. } => a == field || b == field,
            ModelError::Json(_) => false,
        }
    }

    #[track_caller]
    fn assert_names(e: &ModelError, field: &str) {
        assert!(names_field(e, field), "error does not name '{field}': {e:?}");
        assert!(e.to_string().contains(field), "message does not name '{field}': {e}");
    }

    // ---- fixtures: numbers from fixtures/models/SOURCES.md ----

    #[test]
    fn qwen3_explicit_head_dim_and_no_sliding() {
        let m = parse(QWEN3);
        assert_eq!((m.num_layers, m.num_kv_heads, m.head_dim), (28, 8, 128));
        assert_eq!(m.dtype, Some(Dtype::Bf16));
        assert!(m.layers.iter().all(is_full), "use_sliding_window false: all full");
        assert_eq!(m.layers.len(), 28);
        assert_eq!(m.kv_bytes_per_token(Dtype::Bf16), 114_688);
        assert_eq!(m.name, "qwen3 (Qwen3ForCausalLM)");
        assert!(!m.is_hybrid());
        assert!(!m.has_state_layers());
        assert_eq!(m.attention_kinds(), vec![AttentionKind::Full]);
    }

    #[test]
    fn llama_head_dim_from_hidden_size() {
        let m = parse(LLAMA);
        assert_eq!((m.num_layers, m.num_kv_heads, m.head_dim), (32, 8, 128));
        assert_eq!(m.dtype, Some(Dtype::Bf16));
        assert!(m.layers.iter().all(is_full));
        assert_eq!(m.kv_bytes_per_token(Dtype::Bf16), 131_072);
        assert_eq!(m.kv_bytes_per_token(Dtype::Fp8E4m3), 65_536);
        assert_eq!(m.kv_bytes_per_token(Dtype::F32), 262_144);
        assert_eq!(m.kv_layers().len(), 32);
    }

    #[test]
    fn gemma3_five_sliding_one_global() {
        let m = parse(GEMMA3);
        assert_eq!((m.num_layers, m.num_kv_heads, m.head_dim), (26, 1, 256));
        assert_eq!(m.dtype, Some(Dtype::Bf16));
        assert_eq!(indices(&m, is_full), vec![5, 11, 17, 23]);
        let sliding = indices(&m, |k| *k == AttentionKind::SlidingWindow { window: 512 });
        assert_eq!(sliding.len(), 22);
        assert_eq!(sliding.len() + 4, m.layers.len());
        // 1,024 B/token/layer over 26 layers; the window caps tokens, not bytes per token.
        assert_eq!(m.kv_bytes_per_token(Dtype::Bf16), 26_624);
        assert_eq!(
            m.attention_kinds(),
            vec![AttentionKind::SlidingWindow { window: 512 }, AttentionKind::Full]
        );
        assert!(m.is_hybrid());
        assert!(!m.has_state_layers());
    }

    #[test]
    fn gpt_oss_layer_types_and_no_dtype() {
        let m = parse(GPT_OSS);
        assert_eq!((m.num_layers, m.num_kv_heads, m.head_dim), (24, 8, 64));
        assert_eq!(m.dtype, None);
        for (i, k) in m.layers.iter().enumerate() {
            let want =
                if i % 2 == 0 { AttentionKind::SlidingWindow { window: 128 } } else { AttentionKind::Full };
            assert_eq!(*k, want, "layer {i}");
        }
        assert_eq!(m.kv_bytes_per_token(Dtype::Bf16), 49_152);
        assert!(m.is_hybrid());
    }

    #[test]
    fn deepseek_v2_lite_latent_cache() {
        let m = parse(DEEPSEEK);
        assert_eq!(m.num_layers, 27);
        assert_eq!(m.num_kv_heads, 1, "one latent, not the misleading num_key_value_heads 16");
        assert_eq!(m.head_dim, 576);
        assert_eq!(m.dtype, Some(Dtype::Bf16));
        assert!(m
            .layers
            .iter()
            .all(|k| *k == AttentionKind::Mla { kv_lora_rank: 512, qk_rope_head_dim: 64 }));
        assert_eq!(m.kv_bytes_per_token(Dtype::Bf16), 31_104);
        assert!(!m.is_hybrid());
    }

    #[test]
    fn mistral_window_on_every_layer() {
        let m = parse(MISTRAL);
        assert_eq!((m.num_layers, m.num_kv_heads, m.head_dim), (32, 8, 128));
        assert_eq!(m.dtype, Some(Dtype::Bf16));
        assert!(m.layers.iter().all(|k| *k == AttentionKind::SlidingWindow { window: 4096 }));
        assert_eq!(m.kv_bytes_per_token(Dtype::Bf16), 131_072);
        assert!(!m.is_hybrid());
    }

    #[test]
    fn qwen3_next_linear_and_full() {
        let m = parse(QWEN3_NEXT);
        assert_eq!((m.num_layers, m.num_kv_heads, m.head_dim), (48, 2, 256));
        assert_eq!(m.dtype, Some(Dtype::Bf16));
        let full: Vec<u32> = (0..12).map(|k| 4 * k + 3).collect();
        assert_eq!(indices(&m, is_full), full);
        assert_eq!(indices(&m, |k| *k == AttentionKind::Linear).len(), 36);
        assert_eq!(m.kv_layers(), full.iter().map(|&i| LayerId(i)).collect::<Vec<_>>());
        assert_eq!(m.kv_bytes_per_token(Dtype::Bf16), 24_576);
        assert!(m.has_state_layers());
        assert!(!m.is_hybrid(), "only one KV-holding kind");
        // Gated DeltaNet: conv over q, k (16 heads x 128 each) and v (32 x 128), kernel 4.
        let st = m.state.unwrap();
        assert_eq!(st.kind, StateKind::GatedDeltaNet);
        assert_eq!((st.conv_shape, st.conv_dtype), (vec![3, 8192], Dtype::Bf16));
        assert_eq!((st.ssm_shape, st.ssm_dtype), (vec![32, 128, 128], Dtype::Bf16));
    }

    #[test]
    fn nemotron_h_mamba_moe_attention() {
        let m = parse(NEMOTRON);
        assert_eq!((m.num_layers, m.num_kv_heads, m.head_dim), (52, 2, 128));
        assert_eq!(m.dtype, Some(Dtype::Bf16));
        assert_eq!(indices(&m, is_full), vec![5, 12, 19, 26, 33, 42]);
        assert_eq!(indices(&m, |k| *k == AttentionKind::Linear).len(), 23);
        assert_eq!(indices(&m, |k| *k == AttentionKind::FeedForward).len(), 23);
        assert_eq!(m.kv_layers().len(), 6);
        assert_eq!(m.kv_bytes_per_token(Dtype::Bf16), 6_144);
        assert!(m.has_state_layers());
        assert!(!m.is_hybrid());
        assert!(!AttentionKind::FeedForward.has_kv_blocks());
        // Mamba2: conv over x (64 heads x 64) and B, C (8 groups x 128 each), kernel 4; the
        // SSM state in the config's mamba_ssm_cache_dtype.
        let st = m.state.clone().unwrap();
        assert_eq!(st.kind, StateKind::Mamba2);
        assert_eq!((st.conv_shape.clone(), st.conv_dtype), (vec![3, 6144], Dtype::Bf16));
        assert_eq!((st.ssm_shape.clone(), st.ssm_dtype), (vec![64, 64, 128], Dtype::F32));
        assert_eq!(st.bytes(), 3 * 6144 * 2 + 64 * 64 * 128 * 4);
    }

    #[test]
    fn state_dimensions_are_read_not_guessed() {
        // A mixer named by one field needs all of its dimensions.
        let e = err(&edit(NEMOTRON, &[("ssm_state_size", None)]));
        assert!(matches!(e, ModelError::Missing { .. }), "{e:?}");
        assert_names(&e, "ssm_state_size");
        assert_names(&err(&edit(QWEN3_NEXT, &[("linear_key_head_dim", None)])), "linear_key_head_dim");
        assert_names(&err(&edit(NEMOTRON, &[("conv_kernel", Some(1.into()))])), "conv_kernel");
        assert_names(
            &err(&edit(NEMOTRON, &[("mamba_ssm_cache_dtype", Some("float64".into()))])),
            "mamba_ssm_cache_dtype",
        );
        assert_names(&err(&edit(NEMOTRON, &[("mamba_num_heads", Some(u32::MAX.into()))])), "mamba_num_heads");
        let auto = parse(&edit(NEMOTRON, &[("mamba_ssm_cache_dtype", Some("auto".into()))]));
        assert_eq!(auto.state.unwrap().ssm_dtype, Dtype::Bf16, "auto is the model's dtype");
        // State layers whose dimensions the config does not give have no known state.
        let m = parse(
            r#"{"num_hidden_layers":2,"num_attention_heads":2,"head_dim":64,
               "layer_types":["linear_attention","full_attention"]}"#,
        );
        assert!(m.has_state_layers() && m.state.is_none());
        // Models without state layers have none, and their canonical JSON does not mention it.
        assert!(parse(QWEN3).state.is_none());
        assert!(!serde_json::to_string(&parse(QWEN3)).unwrap().contains("state"));
    }

    #[test]
    fn every_fixture_has_a_distinct_stable_fingerprint() {
        let all = [QWEN3, LLAMA, GEMMA3, GPT_OSS, DEEPSEEK, MISTRAL, QWEN3_NEXT, NEMOTRON];
        let prints: Vec<String> = all.iter().map(|j| parse(j).fingerprint()).collect();
        for (i, p) in prints.iter().enumerate() {
            assert_eq!(p.len(), 64);
            assert!(p.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
            assert_eq!(*p, parse(all[i]).fingerprint());
            assert!(!prints[..i].contains(p), "fixture {i} collides");
        }
    }

    #[test]
    fn fingerprint_is_sha256_of_canonical_json() {
        let m = ModelSpec {
            name: "t".into(),
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 4,
            dtype: Some(Dtype::Bf16),
            layers: vec![AttentionKind::SlidingWindow { window: 8 }, AttentionKind::Full],
            state: None,
        };
        let canonical = concat!(
            r#"{"name":"t","num_layers":2,"num_kv_heads":1,"head_dim":4,"dtype":"bf16","#,
            r#""layers":[{"kind":"sliding_window","window":8},{"kind":"full"}]}"#
        );
        assert_eq!(serde_json::to_string(&m).unwrap(), canonical);
        // sha256 of `canonical`, computed outside this crate (Python hashlib).
        assert_eq!(m.fingerprint(), "e89aad20b6949af1c91b948fd72f3660a23c51cb82f946066f61b703075e971a");
        let mut other = m.clone();
        other.layers[0] = AttentionKind::SlidingWindow { window: 9 };
        assert_ne!(other.fingerprint(), m.fingerprint());
    }

    // ---- rules that the fixtures do not cover ----

    #[test]
    fn text_config_is_read() {
        let json = r#"{"architectures":["Gemma3ForConditionalGeneration"],"model_type":"gemma3",
            "torch_dtype":"bfloat16",
            "text_config":{"model_type":"gemma3_text","num_hidden_layers":12,"num_attention_heads":8,
                "num_key_value_heads":4,"head_dim":256,"hidden_size":2560,"sliding_window":1024}}"#;
        let m = parse(json);
        assert_eq!(m.name, "gemma3 (Gemma3ForConditionalGeneration)");
        assert_eq!((m.num_layers, m.num_kv_heads, m.head_dim), (12, 4, 256));
        assert_eq!(m.dtype, Some(Dtype::Bf16), "dtype falls back to the outer config");
        assert_eq!(indices(&m, is_full), vec![5, 11], "gemma3 default pattern 6");
        assert_eq!(m.layers[0], AttentionKind::SlidingWindow { window: 1024 });

        let e = err(r#"{"text_config":{"num_attention_heads":8}}"#);
        assert_names(&e, "text_config.num_hidden_layers");
        assert_names(&err(r#"{"text_config":[1]}"#), "text_config");
    }

    #[test]
    fn gemma2_interleaves_by_default() {
        let m = parse(
            r#"{"model_type":"gemma2","num_hidden_layers":4,"num_attention_heads":8,"num_key_value_heads":4,
               "head_dim":256,"sliding_window":4096}"#,
        );
        let w = AttentionKind::SlidingWindow { window: 4096 };
        assert_eq!(m.layers, vec![w, AttentionKind::Full, w, AttentionKind::Full]);
    }

    #[test]
    fn qwen2_max_window_layers() {
        let base = r#"{"num_hidden_layers":4,"num_attention_heads":4,"hidden_size":256,
            "use_sliding_window":true,"sliding_window":32,"max_window_layers":2}"#;
        let m = parse(base);
        let w = AttentionKind::SlidingWindow { window: 32 };
        assert_eq!(m.layers, vec![AttentionKind::Full, AttentionKind::Full, w, w]);
        assert_eq!((m.num_kv_heads, m.head_dim), (4, 64), "kv heads default to num_attention_heads");

        let off = edit(base, &[("use_sliding_window", Some(Value::Bool(false)))]);
        assert!(parse(&off).layers.iter().all(is_full));
        // use_sliding_window off: sliding_window is not looked at, whatever it holds.
        let off_zero = edit(&off, &[("sliding_window", Some(0.into()))]);
        assert!(parse(&off_zero).layers.iter().all(is_full));
        let no_mwl = edit(base, &[("max_window_layers", None)]);
        assert!(parse(&no_mwl).layers.iter().all(|k| *k == w));
    }

    #[test]
    fn layer_types_linear_and_mamba() {
        let m = parse(
            r#"{"num_hidden_layers":3,"num_attention_heads":2,"head_dim":64,
               "layer_types":["linear_attention","mamba","full_attention"],"dtype":"float16"}"#,
        );
        assert_eq!(m.layers, vec![AttentionKind::Linear, AttentionKind::Linear, AttentionKind::Full]);
        assert_eq!(m.dtype, Some(Dtype::F16));
        assert_eq!(m.name, "unnamed model");
    }

    #[test]
    fn agreeing_sources_are_accepted() {
        // Newer Gemma 3 configs save layer_types beside sliding_window_pattern.
        let mut types = vec![Value::from("sliding_attention"); 26];
        for i in [5, 11, 17, 23] {
            types[i] = "full_attention".into();
        }
        let both = edit(GEMMA3, &[("layer_types", Some(Value::Array(types)))]);
        assert_eq!(parse(&both), parse(GEMMA3));
    }

    #[test]
    fn dtype_names() {
        for (name, want) in [
            ("float32", Dtype::F32),
            ("torch.float16", Dtype::F16),
            ("BF16", Dtype::Bf16),
            ("fp8", Dtype::Fp8E4m3),
            ("float8_e4m3fn", Dtype::Fp8E4m3),
            ("fp8_e5m2", Dtype::Fp8E5m2),
        ] {
            assert_eq!(Dtype::from_hf_name(name), Some(want), "{name}");
            let m = parse(&edit(LLAMA, &[("torch_dtype", Some(name.into()))]));
            assert_eq!(m.dtype, Some(want));
        }
        assert_eq!(Dtype::from_hf_name("float8_e4m3fnuz"), None);
        let both = edit(LLAMA, &[("dtype", Some("bfloat16".into()))]);
        assert_eq!(parse(&both).dtype, Some(Dtype::Bf16));
    }

    // ---- bad input: each error names the field ----

    #[test]
    fn not_json_reports_line_and_column() {
        let e = err("{\n  \"num_hidden_layers\": 32,\n  oops\n}");
        let ModelError::Json(msg) = &e else { panic!("{e:?}") };
        assert!(msg.contains("line 3") && msg.contains("column"), "{msg}");
        assert!(matches!(err("[1, 2]"), ModelError::Json(m) if m.contains("an array")));
        assert!(matches!(err(""), ModelError::Json(_)));
    }

    #[test]
    fn a_layer_count_past_the_ceiling_is_refused_before_a_schedule_is_built() {
        // 77 million layers: building that schedule took seconds and gigabytes.
        let e = err(&edit(LLAMA, &[("num_hidden_layers", Some(77_400_099.into()))]));
        assert!(matches!(e, ModelError::Invalid { .. }), "{e:?}");
        assert_names(&e, "num_hidden_layers");
        assert!(e.to_string().contains("4096"), "{e}");
        let at_ceiling =
            ModelSpec::from_hf_config_json(&edit(LLAMA, &[("num_hidden_layers", Some(MAX_LAYERS.into()))]));
        assert_eq!(at_ceiling.map(|m| m.layers.len()), Ok(MAX_LAYERS as usize));
    }

    #[test]
    fn missing_and_bad_counts() {
        assert_names(&err(&edit(LLAMA, &[("num_hidden_layers", None)])), "num_hidden_layers");
        assert!(matches!(err(&edit(LLAMA, &[("num_hidden_layers", None)])), ModelError::Missing { .. }));
        assert_names(&err(&edit(LLAMA, &[("num_hidden_layers", Some(Value::Null))])), "num_hidden_layers");
        for bad in
            [Value::from(0), Value::from(32.5), Value::from(-1), Value::from("32"), Value::from(1u64 << 40)]
        {
            for field in ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size"] {
                let e = err(&edit(LLAMA, &[(field, Some(bad.clone()))]));
                assert!(matches!(e, ModelError::Invalid { .. }), "{field}={bad}: {e:?}");
                assert_names(&e, field);
            }
            assert_names(&err(&edit(QWEN3, &[("head_dim", Some(bad.clone()))])), "head_dim");
        }
        assert_names(&err(&edit(LLAMA, &[("num_attention_heads", None)])), "num_attention_heads");
        let e = err(&edit(LLAMA, &[("hidden_size", None)]));
        assert!(matches!(e, ModelError::Missing { .. }));
        assert_names(&e, "hidden_size");
        assert_names(&err(&edit(LLAMA, &[("hidden_size", Some(4001.into()))])), "hidden_size");
    }

    #[test]
    fn kv_heads_must_divide_query_heads() {
        let e = err(&edit(LLAMA, &[("num_key_value_heads", Some(12.into()))]));
        assert!(matches!(e, ModelError::Contradiction { .. }));
        assert_names(&e, "num_key_value_heads");
        assert_names(&e, "num_attention_heads");
        assert_names(&err(&edit(LLAMA, &[("num_key_value_heads", Some(64.into()))])), "num_key_value_heads");
    }

    #[test]
    fn unknown_dtype() {
        for field in ["torch_dtype", "dtype"] {
            let e = err(&edit(LLAMA, &[("torch_dtype", None), (field, Some("float64".into()))]));
            assert!(matches!(e, ModelError::Invalid { .. }));
            assert_names(&e, field);
            assert!(e.to_string().contains("float64"));
            assert_names(&err(&edit(LLAMA, &[("torch_dtype", None), (field, Some(16.into()))])), field);
        }
        let e = err(&edit(LLAMA, &[("dtype", Some("float16".into()))]));
        assert!(matches!(e, ModelError::Contradiction { .. }));
        assert_names(&e, "torch_dtype");
    }

    #[test]
    fn bad_layer_types() {
        let short = edit(GPT_OSS, &[("num_hidden_layers", Some(23.into()))]);
        let e = err(&short);
        assert!(matches!(e, ModelError::Contradiction { .. }));
        assert_names(&e, "layer_types");
        assert_names(&e, "num_hidden_layers");

        let mut v: Value = serde_json::from_str(GPT_OSS).unwrap();
        v["layer_types"][3] = "chunked_attention".into();
        let e = err(&v.to_string());
        assert!(matches!(e, ModelError::Invalid { .. }));
        assert_names(&e, "layer_types");
        assert!(e.to_string().contains("entry 3") && e.to_string().contains("chunked_attention"));

        v["layer_types"][3] = 7.into();
        assert_names(&err(&v.to_string()), "layer_types");
        assert_names(&err(&edit(GPT_OSS, &[("layer_types", Some("full".into()))])), "layer_types");
        // Sliding layers need a window.
        let e = err(&edit(GPT_OSS, &[("sliding_window", None)]));
        assert!(matches!(e, ModelError::Missing { .. }));
        assert_names(&e, "sliding_window");
        assert_names(&err(&edit(GPT_OSS, &[("sliding_window", Some(0.into()))])), "sliding_window");
    }

    #[test]
    fn bad_hybrid_override_pattern() {
        let e = err(&edit(NEMOTRON, &[("num_hidden_layers", Some(51.into()))]));
        assert!(matches!(e, ModelError::Contradiction { .. }));
        assert_names(&e, "hybrid_override_pattern");
        assert_names(&e, "num_hidden_layers");

        let mut p: Vec<char> = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME".chars().collect();
        p[7] = 'X';
        let e =
            err(&edit(NEMOTRON, &[("hybrid_override_pattern", Some(p.iter().collect::<String>().into()))]));
        assert!(matches!(e, ModelError::Invalid { .. }));
        assert_names(&e, "hybrid_override_pattern");
        assert!(e.to_string().contains("letter 7 is 'X'"), "{e}");
    }

    #[test]
    fn zero_periods() {
        let e = err(&edit(GEMMA3, &[("sliding_window_pattern", Some(0.into()))]));
        assert!(matches!(e, ModelError::Invalid { .. }));
        assert_names(&e, "sliding_window_pattern");
        assert_names(
            &err(&edit(QWEN3_NEXT, &[("full_attention_interval", Some(0.into()))])),
            "full_attention_interval",
        );
    }

    #[test]
    fn contradicting_sources() {
        // gpt-oss alternates 1:1; a pattern of 6 disagrees at layer 1.
        let e = err(&edit(GPT_OSS, &[("sliding_window_pattern", Some(6.into()))]));
        let ModelError::Contradiction { a, b, reason } = &e else { panic!("{e:?}") };
        assert_eq!((a.as_str(), b.as_str()), ("layer_types", "sliding_window_pattern"));
        assert!(reason.contains("layer 1"), "{reason}");

        let e = err(&edit(
            QWEN3_NEXT,
            &[
                ("full_attention_interval", Some(2.into())),
                ("layer_types", Some(Value::Array(vec![Value::from("linear_attention"); 48]))),
            ],
        ));
        assert!(matches!(e, ModelError::Contradiction { .. }));
        assert_names(&e, "full_attention_interval");

        let e = err(&edit(GPT_OSS, &[("use_sliding_window", Some(false.into()))]));
        assert!(matches!(e, ModelError::Contradiction { .. }));
        assert_names(&e, "use_sliding_window");
        assert_names(
            &err(&edit(MISTRAL, &[("use_sliding_window", Some("yes".into()))])),
            "use_sliding_window",
        );

        let e =
            err(&edit(GEMMA3, &[("kv_lora_rank", Some(512.into())), ("qk_rope_head_dim", Some(64.into()))]));
        assert!(matches!(e, ModelError::Contradiction { .. }));
        assert_names(&e, "kv_lora_rank");
    }

    #[test]
    fn mla_needs_rope_dim() {
        let e = err(&edit(DEEPSEEK, &[("qk_rope_head_dim", None)]));
        assert!(matches!(e, ModelError::Missing { .. }));
        assert_names(&e, "qk_rope_head_dim");
        assert_names(&err(&edit(DEEPSEEK, &[("kv_lora_rank", Some(0.into()))])), "kv_lora_rank");
    }

    proptest! {
        #[test]
        fn never_panics_on_arbitrary_text(s in "\\PC{0,200}") {
            let _ = ModelSpec::from_hf_config_json(&s);
        }

        #[test]
        fn never_panics_on_arbitrary_field_values(
            n in 0u64..70, heads in 0u64..40, kv in 0u64..40, period in 0u64..8,
            pattern in "[ME*\\-X]{0,60}", window in proptest::option::of(0u64..10_000),
        ) {
            let json = serde_json::json!({
                "num_hidden_layers": n, "num_attention_heads": heads, "num_key_value_heads": kv,
                "hidden_size": 4096, "sliding_window_pattern": period,
                "hybrid_override_pattern": pattern, "sliding_window": window,
            });
            if let Ok(m) = ModelSpec::from_hf_config_json(&json.to_string()) {
                prop_assert_eq!(m.layers.len() as u64, n);
            }
        }

        #[test]
        fn periodic_schedule_counts(n in 1u32..200, p in 1u32..10, w in 1u32..5000) {
            let json = serde_json::json!({
                "num_hidden_layers": n, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                "sliding_window": w, "sliding_window_pattern": p,
            });
            let m = ModelSpec::from_hf_config_json(&json.to_string()).unwrap();
            let full = m.layers.iter().filter(|k| is_full(k)).count() as u32;
            prop_assert_eq!(full, n / p);
            prop_assert_eq!(m.kv_layers().len() as u32, n);
            prop_assert_eq!(m.kv_bytes_per_token(Dtype::Bf16), u64::from(n) * 2 * 2 * 64 * 2);
            prop_assert_eq!(m.is_hybrid(), full > 0 && full < n);
        }

        #[test]
        fn hybrid_pattern_counts(pattern in "[ME*\\-]{1,80}") {
            let json = serde_json::json!({
                "num_hidden_layers": pattern.len(), "num_attention_heads": 4, "head_dim": 32,
                "hybrid_override_pattern": pattern,
            });
            let m = ModelSpec::from_hf_config_json(&json.to_string()).unwrap();
            let stars = pattern.matches('*').count();
            prop_assert_eq!(m.kv_layers().len(), stars);
            prop_assert_eq!(m.has_state_layers(), pattern.contains('M'));
            prop_assert_eq!(m.kv_bytes_per_token(Dtype::F16), stars as u64 * 2 * 4 * 32 * 2);
        }
    }
}
