//! vLLM's `kv_transfer_params` for pull-mode P/D: what prefill returns and decode reads.

use kvconnect_api::{BlockId, BlocksPerGroup, ConnectorError, Request};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::net::IpAddr;

/// The params prefill returns for a request finished with `do_remote_decode`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferParams {
    /// The prefill engine's id.
    pub remote_engine_id: String,
    /// The prefill host's side-channel host.
    pub remote_host: String,
    /// The prefill host's side-channel port.
    pub remote_port: u16,
    /// The prefill blocks holding the KV, one list per KV cache group.
    pub remote_block_ids: Vec<Vec<u32>>,
    /// Tokens whose KV those blocks hold.
    pub remote_num_tokens: usize,
    /// Prefill's tensor-parallel size.
    #[serde(default = "one")]
    pub tp_size: u32,
    /// The id prefill holds the blocks under, as newer vLLM sends it. Decode addresses the
    /// producer with it; without it (older proxies and producers), with its own request id,
    /// which a proxy then must have made equal to prefill's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    /// The transfer capability prefill issued for this request (128 random bits, hex): the
    /// producer serves the request's blocks only to a consumer that names it.
    #[serde(default)]
    pub remote_capability: String,
}

/// `host:port`, with an IPv6 host in brackets: how a side channel's address is written.
pub fn side_channel_addr(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn one() -> u32 {
    1
}

fn flag(req: &Request, key: &str) -> bool {
    req.kv_transfer_params.get(key).and_then(Value::as_bool).unwrap_or(false)
}

/// True when the request is a decode's that loads its prompt's KV from a prefill engine
/// (`do_remote_prefill`).
pub fn asks_remote_prefill(req: &Request) -> bool {
    flag(req, "do_remote_prefill")
}

/// True when the client asked prefill to keep the KV for a remote decode.
pub fn wants_remote_decode(req: &Request) -> bool {
    flag(req, "do_remote_decode")
}

impl TransferParams {
    /// The JSON object vLLM's proxies forward to decode.
    pub fn to_map(&self) -> Map<String, Value> {
        let mut m = match serde_json::to_value(self) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        };
        m.insert("do_remote_prefill".into(), Value::Bool(true));
        m.insert("do_remote_decode".into(), Value::Bool(false));
        m
    }

    /// The params of a decode request that carries `do_remote_prefill`; `None` for any other
    /// request; an error of `connector` naming the field when the params are malformed.
    pub fn from_request(connector: &str, req: &Request) -> Result<Option<TransferParams>, ConnectorError> {
        if !asks_remote_prefill(req) {
            return Ok(None);
        }
        let params: TransferParams = serde_json::from_value(Value::Object(req.kv_transfer_params.clone()))
            .map_err(|e| {
                ConnectorError::invalid(
                    connector,
                    format!(
                        "request {}: kv_transfer_params has do_remote_prefill but cannot be read ({e}); \
                            expected remote_engine_id, remote_host, remote_port, remote_block_ids (one list \
                            per KV cache group) and remote_num_tokens as prefill returned them",
                        req.id
                    ),
                )
            })?;
        // The params come from a client: a host name in them is never resolved.
        if params.remote_host.parse::<IpAddr>().is_err() {
            return Err(ConnectorError::invalid(
                connector,
                format!(
                    "request {}: kv_transfer_params remote_host {:?} is not an IP address; prefill returns \
                        its side-channel IP, forward it unchanged",
                    req.id,
                    params.remote_host.chars().take(64).collect::<String>()
                ),
            ));
        }
        Ok(Some(params))
    }

    /// The prefill side channel's address, as the host's handshake names it.
    pub fn side_channel(&self) -> String {
        side_channel_addr(&self.remote_host, self.remote_port)
    }

    /// The remote blocks as typed ids.
    pub fn blocks(&self) -> BlocksPerGroup {
        BlocksPerGroup(
            self.remote_block_ids.iter().map(|g| g.iter().map(|b| BlockId(*b)).collect()).collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn round_trip_through_a_request() {
        let p = TransferParams {
            remote_engine_id: "prefill-0".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: 5600,
            remote_block_ids: vec![vec![3, 4], vec![7]],
            remote_num_tokens: 20,
            tp_size: 1,
            remote_request_id: Some("cmpl-abc".into()),
            remote_capability: "00112233445566778899aabbccddeeff".into(),
        };
        let req = Request { id: "r".into(), prompt_tokens: vec![1; 20], kv_transfer_params: p.to_map() };
        assert_eq!(TransferParams::from_request("test", &req).unwrap(), Some(p.clone()));
        assert_eq!(req.kv_transfer_params["do_remote_decode"], json!(false));
        assert_eq!(req.kv_transfer_params["remote_request_id"], json!("cmpl-abc"));
        assert_eq!(req.kv_transfer_params["remote_capability"], json!("00112233445566778899aabbccddeeff"));
        // Params from a producer that does not send the id still read.
        let mut older = p.to_map();
        older.remove("remote_request_id");
        let req = Request { id: "r".into(), prompt_tokens: vec![1; 20], kv_transfer_params: older };
        assert_eq!(TransferParams::from_request("test", &req).unwrap().unwrap().remote_request_id, None);
    }

    #[test]
    fn malformed_params_are_an_error_and_absent_ones_none() {
        let mut req = Request { id: "r".into(), prompt_tokens: vec![], kv_transfer_params: Map::new() };
        assert_eq!(TransferParams::from_request("test", &req).unwrap(), None);
        req.kv_transfer_params.insert("do_remote_prefill".into(), json!(true));
        req.kv_transfer_params.insert("remote_port".into(), json!("x"));
        let e = TransferParams::from_request("test", &req).unwrap_err().to_string();
        assert!(e.contains("request r") && e.contains("remote_"), "{e}");
    }

    #[test]
    fn a_host_name_in_the_params_is_refused() {
        let p = TransferParams {
            remote_engine_id: "prefill-0".into(),
            remote_host: "::1".into(),
            remote_port: 5600,
            remote_block_ids: vec![vec![3]],
            remote_num_tokens: 16,
            tp_size: 1,
            remote_request_id: None,
            remote_capability: "00112233445566778899aabbccddeeff".into(),
        };
        let req = |p: &TransferParams| Request {
            id: "r".into(),
            prompt_tokens: vec![],
            kv_transfer_params: p.to_map(),
        };
        assert!(TransferParams::from_request("test", &req(&p)).unwrap().is_some());
        for host in ["localhost", "metadata.internal", "10.0.0.1:80", ""] {
            let bad = TransferParams { remote_host: host.into(), ..p.clone() };
            let e = TransferParams::from_request("test", &req(&bad)).unwrap_err().to_string();
            assert!(e.contains("not an IP address") && e.contains("request r"), "{host}: {e}");
        }
    }
}
