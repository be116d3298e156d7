package sampledriver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func (s *server) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{
		Name:          s.cfg.Name,
		VendorVersion: s.cfg.Version,
		Manifest:      map[string]string{"project": "csibroker", "kind": "sample"},
	}, nil
}

func (s *server) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	caps := []*csi.PluginCapability{
		serviceCap(csi.PluginCapability_Service_CONTROLLER_SERVICE),
		{Type: &csi.PluginCapability_VolumeExpansion_{VolumeExpansion: &csi.PluginCapability_VolumeExpansion{
			Type: csi.PluginCapability_VolumeExpansion_ONLINE,
		}}},
	}
	if !s.cfg.DisableGroupSnapshots {
		caps = append(caps, serviceCap(csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE))
	}
	if len(s.cfg.Topology) > 0 || len(s.cfg.ControllerSegments) > 0 {
		caps = append(caps,
			serviceCap(csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS),
			serviceCap(csi.PluginCapability_Service_SNAPSHOT_ACCESSIBILITY_CONSTRAINTS))
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

func serviceCap(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
	return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}}}
}

func (s *server) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
